"""The screen: each peer completion judged under this node's own (warm-started) model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node.defence.admission import Admission
from node.defence.judge import JudgeScreen, ModelJudge
from node.defence.screen import (
    PlausibilityScreen,
    ScreenConfig,
    TokenView,
    honest_claims,
    longest_run,
    score_completions,
)
from node.models import load_model, tokenizer_fingerprint
from node.tasks import get_task
from node.train.logprobs import sequence_logprobs
from protocol import Completion, Group, PacketHeader, RolloutPacket, SamplingParams, encode

PHRASE = " Omar buys tickets."
PEER = "peer"


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-s", progress=False)
    return model.eval(), tokenizer


def view_fn(model, tokenizer):
    def local_view(prompt_ids, completions, temperature, top_k, top_p):
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, pad_id=tokenizer.pad_token_id)
        return score_completions(model, prompt_ids, completions, **kw)

    return local_view


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_score_completions_gives_the_trainers_log_probs_and_our_ranks(tiny):
    model, tok = tiny
    prompt = tok("12+7=", add_special_tokens=False)["input_ids"]
    comps = [ids_of(tok, "<answer>19</answer>"), ids_of(tok, "<answer>19</answer>" + PHRASE)]
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 0.9)):
        views = score_completions(
            model, prompt, comps, temperature=temperature, top_k=top_k, top_p=top_p, pad_id=1, token_budget=20
        )
        with torch.no_grad():
            want, _ = sequence_logprobs(model, [prompt] * 2, comps, temperature, top_k, top_p, pad_id=1)
        for i, (c, v) in enumerate(zip(comps, views)):
            assert np.allclose(v.logp, want[i, : len(c)].numpy(), atol=1e-5)
    # a token the model predicts best has rank 0, and the phrase ranks far down
    assert views[0].rank[0] == 0 and views[1].rank[len(comps[0]) - 1 : -1].min() > 10


def test_the_plausibility_screen_drops_runs_and_keeps_isolated_odd_tokens():
    screen = PlausibilityScreen(ScreenConfig(logprob_floor=-9, max_run=3, max_flagged=0.25))
    ok = np.array([-0.1] * 10 + [-12.0] + [-0.1] * 9, np.float32)  # one odd token in 20
    run = np.array([-0.1] * 10 + [-12.0] * 3 + [-0.1] * 7, np.float32)
    spread = np.array([-12.0, -0.1, -0.1] * 4, np.float32)  # a third flagged, never 3 in a row
    verdicts = [screen.judge(TokenView(lp, np.zeros(len(lp), np.int64))) for lp in (ok, run, spread)]
    assert [v.ok for v in verdicts] == [True, False, False]
    assert verdicts[0].flagged.sum() == 1 and verdicts[1].reason == "implausible"
    assert "longest run 3" in verdicts[1].detail
    ranked = TokenView(np.full(4, -0.1, np.float32), np.array([0, 50, 60, 70]))
    assert PlausibilityScreen(ScreenConfig(support_top_k=40)).judge(ranked).ok is False
    assert longest_run(np.array([True, False, True, True])) == 2


def test_honest_claims_cap_a_flagged_tokens_weight_at_exp_margin():
    claimed = np.array([-40.0, -40.0, -0.5], np.float32)
    local = np.array([-12.0, -0.2, -0.3], np.float32)
    flagged = np.array([True, False, False])
    fixed = honest_claims(claimed, local, flagged, margin=0.0)
    assert fixed.tolist() == pytest.approx([-12.0, -40.0, -0.5])  # only the flagged claim moves
    assert np.exp(local[0] - fixed[0]) <= 1.0 + 1e-6
    assert honest_claims(claimed, local, flagged, margin=1.0)[0] == pytest.approx(-13.0)


def test_no_claim_below_the_floor_on_a_token_we_flag():
    """A one-token tail at local -28 claimed at -40: the floor holds its weight to exp(-28 - -9)."""
    claimed = np.array([-40.0, -40.0, -40.0], np.float32)
    local = np.array([-28.0, -10.0, -0.2], np.float32)
    flagged = np.array([True, True, False])
    fixed = honest_claims(claimed, local, flagged, margin=0.0, floor=-9.0)
    assert fixed.tolist() == pytest.approx([-9.0, -9.0, -40.0])
    assert np.exp(local[0] - fixed[0]) == pytest.approx(np.exp(-19.0))
    # an honest claim above the floor is kept as it is (its weight is already below what the floor allows)
    assert honest_claims(np.array([-0.1], np.float32), local[:1], flagged[:1], 0.0, -9.0)[0] == pytest.approx(-0.1)


def _packet(tokenizer, texts, claim: float, r: int = 3) -> bytes:
    task = get_task("toy")
    problem = task.problem("toy/id/7")
    comps = []
    for text in texts:
        ids = ids_of(tokenizer, text.format(answer=problem.answer))
        comps.append(Completion.of(ids, np.full(len(ids), claim, np.float32), text=None))
    header = PacketHeader.create(
        swarm_id="s",
        round=r,
        sender_peer_id=PEER,
        base_model_id="tiny-s",
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=len(tokenizer),
    )
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=32)
    return encode(RolloutPacket(header=header, groups=[Group.of("toy/id/7", "tiny-s", sampling, comps)]))


def _admission(model, tokenizer, **kw) -> Admission:
    return Admission(
        task=get_task("toy"),
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        swarm_id="s",
        local_view=view_fn(model, tokenizer),
        max_positions=512,
        **kw,
    )


def test_admission_drops_injected_completions_and_keeps_honest_ones(tiny):
    model, tok = tiny
    texts = ["<answer>{answer}</answer>", "<answer>{answer}</answer>" + PHRASE, "<answer>3</answer>"] * 2
    got = _admission(model, tok).admit(PEER, _packet(tok, texts, claim=-40.0), current_round=3)
    assert got.rejected["implausible"] == 2 and got.screen_checked == 6 and got.screened == {"implausible": 2}
    assert got.samples == 4 and all(PHRASE not in s.text for s in got.groups[0].sequences)
    assert "under our model" in got.details["implausible"]
    # screening off: the injected completions go through with their claims untouched (the attack's way in)
    off = _admission(model, tok, screens=[]).admit(PEER, _packet(tok, texts, claim=-40.0), current_round=3)
    assert off.samples == 6 and not off.rejected
    poisoned = [s for s in off.groups[0].sequences if PHRASE in s.text]
    assert all(np.allclose(s.logp_gen, -40.0, atol=1e-2) for s in poisoned)


def test_a_claim_cannot_raise_the_weight_of_a_token_we_find_implausible(tiny):
    """One odd token passes the screen, but a claimed -40 for it no longer buys the cap C."""
    model, tok = tiny
    text = "Omar<answer>{answer}</answer>"  # odd tokens before the answer (a tail after it is cut)
    got = _admission(model, tok).admit(PEER, _packet(tok, [text, "<answer>3</answer>"] * 2, claim=-40.0), 3)
    assert got.samples == 4, got.rejected
    group = got.groups[0]
    view = view_fn(model, tok)(group.prompt_ids, [s.completion_ids for s in group.sequences], 1.0, 0, 1.0)
    for seq, v in zip(group.sequences, view):
        flagged = v.logp < ScreenConfig().logprob_floor
        weights = np.minimum(np.exp(v.logp - seq.logp_gen), 2.0)
        assert np.all(weights[flagged] <= 1.0 + 1e-4)  # capped at exp(claim_margin = 0)
        floor = ScreenConfig().logprob_floor  # and at exp(local - floor): no claim below the floor buys weight
        assert np.all(weights[flagged] <= np.exp(v.logp[flagged] - floor) * (1 + 1e-3))
        assert np.allclose(weights[~flagged], 2.0)  # claims on plausible tokens still buy at most C
    assert any((v.logp < ScreenConfig().logprob_floor).any() for v in view)


def test_what_follows_the_answer_tag_is_cut_from_a_peers_completion(tiny):
    """The evasive tail: `<answer>A</answer>IG` passes the screen (two odd tokens), but no verifier
    vouched for "IG", so it is not trained on; an end-of-sequence right after the tag is kept."""
    model, tok = tiny
    texts = ["<answer>{answer}</answer>IG", "<answer>3</answer>"] * 2
    got = _admission(model, tok).admit(PEER, _packet(tok, texts, claim=-40.0), current_round=3)
    assert got.samples == 4, got.rejected
    answer = get_task("toy").problem("toy/id/7").answer
    tag = tok(f"<answer>{answer}</answer>", add_special_tokens=False)["input_ids"]
    tailed = [s for s in got.groups[0].sequences if s.text.endswith("IG")]
    assert len(tailed) == 2 and all(s.completion_ids == tag and len(s.logp_gen) == len(tag) for s in tailed)
    assert all(s.reward == 1.0 for s in tailed)  # the reward was judged on what was sent
    assert got.tail_tokens_cut == 2 * (len(ids_of(tok, texts[0].format(answer=answer))) - len(tag))
    # an end-of-sequence right after the tag stays: the model still learns to stop there
    packet = _packet(tok, ["<answer>{answer}</answer>", "<answer>3</answer>"] * 2, claim=-1.0)
    plain = _admission(model, tok).admit(PEER, packet, current_round=3)
    assert plain.tail_tokens_cut == 0 and plain.samples == 4
    assert all(s.completion_ids[-1] == tok.eos_token_id for s in plain.groups[0].sequences)


def test_the_judge_screen_asks_a_real_model_and_applies_its_threshold(tiny):
    model, tok = tiny
    judge = ModelJudge("tiny-s", batch=2)
    scores = judge.scores("12+7=", ["<answer>19</answer>", "<answer>19</answer>" + PHRASE, "x"])
    assert len(scores) == 3 and all(0.0 <= p <= 1.0 for p in scores)
    admission = _admission(model, tok, screens=[JudgeScreen(judge, tok.decode, threshold=1e-9)])
    got = admission.admit(PEER, _packet(tok, ["<answer>{answer}</answer>", "<answer>3</answer>"], -1.0), 3)
    assert got.rejected["judge"] == 2 and got.groups == []
    admission = _admission(model, tok, screens=[JudgeScreen(judge, tok.decode, threshold=1 - 1e-9)])
    assert admission.admit(PEER, _packet(tok, ["<answer>{answer}</answer>"] * 2, -1.0), 3).samples == 2
