"""The benchmark suite: machine description, engine bench, and the JSON + markdown report.

The report comes from a real quick run of every benchmark (the suite's own quick
settings, with the session's tiny model in place of the warm-started tiny-s, whose
first build takes minutes), and a real benchmark failing on bad input. `run_all` itself
runs with the protocol benchmark only, for the same reason. No timing is asserted: only
that the figures exist, are sane, and land in both files with the right verdicts.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from node.bench.engines import format_engine_bench, run_engine_bench
from node.bench.machine import describe_machine
from node.bench.suite import (
    BENCH_NAMES,
    REGENERATE,
    BenchSpec,
    default_specs,
    evaluate_goals,
    format_suite,
    render_markdown,
    run_all,
    run_specs,
    write_report,
)


def test_describe_machine() -> None:
    m = describe_machine()
    for key in (
        "cpu_model",
        "cores_logical",
        "cores_usable",
        "memory",
        "gpus",
        "python",
        "versions",
        "torch_threads",
        "date_utc",
    ):
        assert key in m, key
    assert m["cores_logical"] > 0 and 0 < m["cores_usable"] <= m["cores_logical"]
    assert m["memory"]["total_gib"] > 0
    assert m["torch_threads"] > 0
    assert set(m["versions"]) >= {"torch", "transformers", "hivemind", "numpy"}
    assert m["versions"]["torch"] and m["versions"]["numpy"]
    assert dt.datetime.fromisoformat(m["date_utc"]).utcoffset() == dt.timedelta(0)
    json.dumps(m)  # JSON-able as it is


def _quick_specs(model_dir: Path) -> list[BenchSpec]:
    """The suite's own quick specs, with the project model swapped for the session's tiny model."""
    specs = []
    for s in default_specs(quick=True):
        kwargs = dict(s.kwargs)
        if "model" in kwargs:
            kwargs["model"] = str(model_dir)
        if "models" in kwargs:
            kwargs.update(models=[str(model_dir)], n=2, max_tokens=6)
        specs.append(replace(s, kwargs=kwargs))
    return specs


@pytest.fixture(scope="module")
def report(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every benchmark, quick and for real, written to JSON and markdown."""
    specs = _quick_specs(tiny_model_dir)
    assert [s.name for s in specs] == list(BENCH_NAMES)
    out = tmp_path_factory.mktemp("report")
    result = run_specs(specs, quick=True, command="ftis-node bench all --quick", progress=None)
    write_report(result, out / "bench.json", out / "docs" / "benchmarks.md")
    return {
        "result": result,
        "json": out / "bench.json",
        "md": out / "docs" / "benchmarks.md",
        "model": str(tiny_model_dir),
    }


def test_every_benchmark_ran(report: dict) -> None:
    benches = report["result"]["benchmarks"]
    assert list(benches) == list(BENCH_NAMES)
    for name, r in benches.items():
        assert "error" not in r, (name, r.get("error"), r.get("traceback"))
    assert benches["train"]["tokens_per_step"] == 4 * 8
    assert benches["gather"]["by_size"]["2"]["incomplete_gathers"] == 0


def test_a_failing_benchmark_is_recorded_and_the_rest_still_run(tmp_path: Path) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    specs = [
        BenchSpec("train", "node.bench.train", "run_train_bench", {"model": str(not_a_model)}),
        next(s for s in default_specs(quick=True) if s.name == "protocol"),
    ]
    result = run_specs(specs, progress=None)
    assert "not a model folder" in result["benchmarks"]["train"]["error"]
    assert "Traceback" in result["benchmarks"]["train"]["traceback"]
    assert result["benchmarks"]["protocol"]["bytes_per_token"] > 0
    assert all(g["passed"] is None for g in result["goals"] if g["bench"] == "train")
    write_report(result, None, tmp_path / "b.md")
    md = (tmp_path / "b.md").read_text()
    assert "This benchmark failed" in md and "not a model folder" in md and "## Wire protocol" in md
    assert "train: FAILED" in format_suite(result)


def test_engine_figures_are_real(report: dict) -> None:
    r = report["result"]["benchmarks"]["engines"]
    m = r["hf"][report["model"]]
    assert m["n_params"] > 0 and m["load_s"] > 0 and m["tokens_per_s"] > 0 and m["tokens_per_s_lora"] > 0
    assert m["tokens_per_call"] == pytest.approx(m["mean_completion_tokens"] * 2 * 2)  # prompts x n
    assert 1 <= m["mean_completion_tokens"] <= 6
    assert m["adapter_first_load_s"] > 0 and m["adapter_reload_s"] > 0
    assert m["lora_params"] > 0 and m["adapter_bytes"] > 0
    # Recorded log-probs equal the trainer's recompute, with and without the adapter ...
    assert m["logprob_max_abs_diff"] < 1e-4 and m["logprob_max_abs_diff_lora"] < 1e-4
    # ... and the adapter really changed the policy the engine samples from.
    assert m["adapter_shift_mean_abs"] > 100 * max(m["logprob_max_abs_diff_lora"], 1e-7)
    if importlib.util.find_spec("vllm") is None:
        assert r["vllm"] == "not installed"
    assert "hf/" in format_engine_bench(r)


def test_json_report(report: dict) -> None:
    doc = json.loads(report["json"].read_text())
    assert doc["command"] == "ftis-node bench all --quick" and doc["quick"] is True
    assert doc["machine"]["cores_usable"] > 0
    assert doc["settings"]["engines"]["max_tokens"] == 6
    assert (
        doc["benchmarks"]["protocol"]["bytes_per_token"]
        == report["result"]["benchmarks"]["protocol"]["bytes_per_token"]
    )
    assert list(doc["elapsed_s"]) == list(BENCH_NAMES)
    verdicts = {g["figure"]: g for g in doc["goals"]}
    bpt = verdicts["bytes per token (vocab 151,646, no zstd)"]
    assert bpt["value"] == pytest.approx(doc["benchmarks"]["protocol"]["bytes_per_token"])
    assert bpt["passed"] is (bpt["value"] <= 4.5)
    train = doc["benchmarks"]["train"]
    for g in doc["goals"]:
        if g["bench"] == "train":  # measured, with a verdict that follows the target
            assert g["passed"] is (g["value"] <= g["target"])
    assert verdicts["F-TIS step time / TRL GRPOTrainer step time"]["value"] == pytest.approx(train["ratio_vs_trl"])
    # The quick gather runs 2 nodes only, so the goal at 32 peers is not measured.
    assert verdicts["gather median at 32 peers"]["passed"] is None


def test_markdown_report(report: dict) -> None:
    md = report["md"].read_text()
    assert md.startswith("# Benchmarks\n")
    for heading in (
        "## Machine",
        "## Goals",
        "## Wire protocol",
        "## Training step",
        "## Gather latency",
        "## Rollout engines",
        "## Fuzzing decode and admission",
    ):
        assert heading in md, heading
    assert "median over repeats" in md and "side by side in the same run" in md
    assert REGENERATE in md
    assert "| benchmark | figure | value | goal | pass/fail |" in md
    bpt = report["result"]["benchmarks"]["protocol"]["bytes_per_token"]
    assert f"| {bpt:.3g} B/token | <= 4.5 B/token |" in md
    assert "not measured" in md and "This benchmark failed" not in md
    assert report["model"] in md  # the engine row
    assert "| 2 | " in md  # the gather row for 2 nodes
    assert md == render_markdown(report["result"])
    text = format_suite(report["result"])
    assert "Goals:" in text and "FAILED" not in text and "B/token" in text and "gather, 2 nodes" in text


def test_goal_verdicts_follow_the_targets() -> None:
    protocol = {"bytes_per_token": 4.6, "encode_tokens_per_s": 40e6, "decode_tokens_per_s": 40e6}
    gather = {"gather_s_median": {"2": 0.1, "32": 0.5}, "bytes_read_per_node": {"8": 100, "32": 150}}
    verdicts = {(g["bench"], g["figure"]): g for g in evaluate_goals({"protocol": protocol, "gather": gather})}
    assert verdicts["protocol", "bytes per token (vocab 151,646, no zstd)"]["passed"] is False
    trip = verdicts["protocol", "encode + decode (validated), one packet"]
    assert trip["value"] == pytest.approx(20.0) and trip["passed"] is True  # 1 / (1/40 + 1/40)
    assert verdicts["gather", "gather median at 32 peers"]["passed"] is True  # the bound is inclusive
    assert verdicts["gather", "bytes read per node, 32 peers / 8 peers"]["passed"] is True
    gather_without_8 = evaluate_goals({"gather": {"gather_s_median": {"2": 0.1}}})
    assert next(g for g in gather_without_8 if g["bench"] == "gather")["passed"] is None


def test_run_all_writes_both_files(tmp_path: Path) -> None:
    result = run_all(tmp_path / "b.json", tmp_path / "b.md", quick=True, only=["protocol"], progress=None)
    assert list(result["benchmarks"]) == ["protocol"]
    assert json.loads((tmp_path / "b.json").read_text())["benchmarks"]["protocol"]["repeats"] == 1
    assert "## Wire protocol" in (tmp_path / "b.md").read_text()
    with pytest.raises(ValueError, match="unknown benchmark.*available: protocol, train, gather, engines, fuzz"):
        run_all(None, None, only=["protcol"])


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="non-empty list"):
        run_engine_bench(models="tiny-s")
    with pytest.raises(ValueError, match="prompts must be >= 1"):
        run_engine_bench(prompts=0)
    with pytest.raises(ValueError, match="names must be unique"):
        run_specs([default_specs(True)[0], default_specs(True)[0]], progress=None)
