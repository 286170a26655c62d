"""Swarm-gain benchmark: does a node learn more in a swarm than alone, at equal generation?

Every configuration runs N real `node.daemon.Node`s (the daemon's own rollout, admission,
screen, mixing, F-TIS step and engine reload) on the experiment's in-process exchange
(`node.experiment.exchange`): packets are the encoded bytes a node publishes, and each
receiver decodes, re-scores, screens and mixes them as it would a DHT peer's. Rounds run
in lockstep (everyone publishes, then everyone gathers and trains), as a swarm with
synchronised rounds. The swarm's members are trusted from round 0 (probation off): in an
open swarm a newcomer's first rounds use fewer peer samples.

Equal generation: in every configuration each node answers `prompts_per_round` prompts
`group_size` times per round and trains on a batch of the same size. The mix is SAPO's
I local / J external at a fixed batch (`peer_mix=replace`): share 0.5 is 4/4 (half the
batch's groups are peers'), 0.25 is 6/2; isolation is 8/0 (`loss=alone`, no exchange).
Loss: NoIS (peers' samples treated as on-policy, SAPO's treatment) or F-TIS.

Swarms: homogeneous (one model, one temperature, nodes differ by seed: SAPO's setting)
and heterogeneous (one temperature per node, so the partners sample different
distributions: the paper's setting). Each node's isolation run is its own, at its own
temperature and seed, so a node's prompts are the same in every configuration.

Figures per node: cumulative training reward (the sum over rounds of the mean reward of
its own samples: SAPO's figure), held-out reward before/after on fixed problems of the
training tasks and on task types no node trains on (OOD), both `eval_problems` x
`eval_samples` at the node's own temperature and a fixed seed (`node.bench.learn`'s eval),
and the off-policy diagnostics (IS weight mean, tokens capped, sequences filtered, peer
samples used). Each finished run is saved under `work/runs/`, and a rerun skips it.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PRESETS", "GainSettings", "mix_label", "run_swarm_gain"]

TRAIN_TASK = (
    "mix:gym:chain_sum?max_terms=2&max_digits=1,"
    "gym:basic_arithmetic?max_terms=2&max_digits=1&allow_parentheses=false&allow_negation=false,"
    "gym:leg_counting?min_animals=1&max_animals=2&max_instances=3"
)
OOD_TASK = "mix:gym:products?max_digits=1,gym:gcd?max_value=20"
Loss = Literal["nois", "f-tis"]
SwarmKind = Literal["homogeneous", "heterogeneous"]
LOSSES: tuple[Loss, ...] = ("nois", "f-tis")
SWARMS: tuple[SwarmKind, ...] = ("homogeneous", "heterogeneous")


class GainSettings(BaseModel):
    """One swarm-gain run's settings (a preset, with any field overridden)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2-135m-embedded"
    nodes: int = Field(2, ge=2)
    rounds: int = Field(8, ge=1)
    prompts_per_round: int = Field(4, ge=2)
    group_size: int = Field(8, ge=2)
    max_tokens: int = Field(32, ge=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1], min_length=1)
    shares: list[float] = Field(default_factory=lambda: [0.5], min_length=1)  # 0.5 = 4/4, 0.25 = 6/2
    losses: list[Loss] = Field(default_factory=lambda: list(LOSSES), min_length=1)
    swarms: list[SwarmKind] = Field(default_factory=lambda: list(SWARMS))
    temperature: float = Field(0.7, gt=0, description="The homogeneous swarm's (the instruct default).")
    hetero_temperatures: tuple[float, float] = Field((0.5, 1.0), description="Lowest and highest, spread over nodes.")
    lr: float | None = Field(2e-4, gt=0, description="LoRA learning rate (bench learn: 2e-4 suits SmolLM2).")
    task: str = TRAIN_TASK
    ood_task: str = OOD_TASK
    eval_problems: int = Field(32, ge=1)
    eval_samples: int = Field(4, ge=1)
    eval_seed: int = 0
    threads: int = Field(0, ge=0, description="Torch threads (0: all cores; the nodes take turns).")

    def temperatures(self, swarm: str) -> list[float]:
        if swarm == "homogeneous":
            return [self.temperature] * self.nodes
        lo, hi = self.hetero_temperatures
        return [round(lo + (hi - lo) * i / (self.nodes - 1), 3) for i in range(self.nodes)]

    def node_seed(self, seed: int, index: int) -> int:
        return seed * 100 + index  # pinned: the same prompts for node i in every configuration

    def configurations(self) -> list[tuple[str, str, float]]:
        """(swarm, loss, share) of each shared configuration."""
        return [(s, loss, share) for s in self.swarms for share in self.shares for loss in self.losses]


PRESETS: dict[str, dict[str, Any]] = {
    # SmolLM2, the paper's setting only (a heterogeneous pair: the F-TIS vs NoIS question); 12
    # node-runs of 8 rounds, each with its held-out and OOD evals (docs/swarm-gain.md has the time).
    "short": dict(
        nodes=2,
        rounds=8,
        prompts_per_round=4,
        group_size=8,
        max_tokens=32,
        seeds=[0, 1],
        shares=[0.5],
        swarms=["heterogeneous"],
        hetero_temperatures=(0.7, 1.0),
    ),
    # The short pair for 40 rounds at 6/2, F-TIS first: the notes' (docs/swarm-gain-notes.md)
    # next step, long enough for the policies to part and with most of each batch the node's own.
    "long": dict(
        nodes=2,
        rounds=40,
        prompts_per_round=4,
        group_size=8,
        max_tokens=32,
        seeds=[0],
        shares=[0.25],
        losses=["f-tis", "nois"],
        swarms=["heterogeneous"],
        hetero_temperatures=(0.7, 1.0),
    ),
    "full": dict(
        nodes=4,
        rounds=40,
        prompts_per_round=8,
        group_size=8,
        max_tokens=64,
        seeds=[0, 1, 2],
        shares=[0.5, 0.25],
        hetero_temperatures=(0.4, 1.0),
    ),
    # The project's tiny models on the toy task: the whole grid in about half an hour on 2 cores.
    "toy": dict(
        model="tiny-m",
        nodes=2,
        rounds=20,
        prompts_per_round=4,
        group_size=8,
        max_tokens=12,
        seeds=[0, 1],
        shares=[0.5, 0.25],
        task="toy",
        ood_task="toy:ood",
        temperature=1.0,
        hetero_temperatures=(1.0, 1.4),
        lr=2e-3,  # the experiment's LoRA rate for the tiny models (docs/reproduction.md)
        eval_problems=64,
    ),
    # The end-to-end test's: tiny model, a few seconds a run.
    "tiny": dict(
        model="tiny-s",
        nodes=2,
        rounds=3,
        prompts_per_round=4,
        group_size=4,
        max_tokens=8,
        seeds=[0],
        shares=[0.5],
        swarms=["homogeneous"],
        task="toy",
        ood_task="toy:ood",
        temperature=1.0,
        lr=1e-3,
        eval_problems=8,
        eval_samples=2,
    ),
}


def mix_label(share: float) -> str:
    """SAPO's local/external notation for a batch of 8."""
    peers = round(8 * share)
    return f"{8 - peers}/{peers}"


# ---------------------------------------------------------------------------- one run


def _node_config(s: GainSettings, data_dir: Path, name: str, *, temperature: float, seed: int, loss: str, share: float):
    from node.config import NodeConfig

    return NodeConfig(
        name=name,
        data_dir=data_dir,
        model=s.model,
        task=s.task,
        prompts_per_round=s.prompts_per_round,
        group_size=s.group_size,
        max_tokens=s.max_tokens,
        temperature=temperature,
        lr=s.lr,
        seed=seed,
        loss=loss,
        peer_share=share,
        peer_mix="replace",
        swarm_id="swarm-gain",
        gather_seconds=0.0,  # lockstep: every partner has published before anyone gathers
        expect_peers=s.nodes - 1,
        probation_rounds=0,  # the swarm's own members (see the module docstring)
        checkpoint_every=s.rounds + 1,  # learning, not the disk
        threads=s.threads,
        api_port=None,
    )


def _evals(s: GainSettings) -> dict[str, Any]:
    from node.experiment.evaluate import eval_set

    return {
        "heldout": eval_set("heldout", s.task, s.eval_problems, seed=s.eval_seed),
        "ood": eval_set("ood", s.ood_task, s.eval_problems, seed=s.eval_seed),
    }


def _evaluate(node, s: GainSettings, evals: dict[str, Any]) -> dict[str, float]:
    from node.experiment.evaluate import sampled_reward_mean

    return {k: sampled_reward_mean(node, e, s.max_tokens, s.eval_samples, s.eval_seed) for k, e in evals.items()}


def _run(
    s: GainSettings,
    *,
    temperatures: list[float],
    seeds: list[int],
    loss: str,
    share: float,
    evals: dict[str, Any],
    before_cache: _BeforeEvals,
    say: Callable[[str], None],
    label: str,
) -> list[dict[str, Any]]:
    """Nodes with these temperatures and seeds, on one exchange (or alone, for isolation)."""
    from node.daemon import Node
    from node.experiment.exchange import ExchangeHub
    from node.experiment.runner import _round_record

    alone = loss == "alone"
    nodes: list = []
    with tempfile.TemporaryDirectory(prefix="ftis-swarm-gain-") as tmp:
        hub = ExchangeHub("swarm-gain")
        try:
            for i, (temp, seed) in enumerate(zip(temperatures, seeds)):
                cfg = _node_config(s, Path(tmp) / f"n{i}", f"n{i}", temperature=temp, seed=seed, loss=loss, share=share)
                exchange = (ExchangeHub("swarm-gain") if alone else hub).endpoint(f"n{i}")
                nodes.append(Node(cfg, exchange=exchange).setup())
            before = []
            for node, temp in zip(nodes, temperatures):
                # LoRA starts as the identity: the same start in every run.
                before.append(before_cache.get(s.model, temp, functools.partial(_evaluate, node, s, evals)))
            curves: list[list[dict[str, Any]]] = [[] for _ in nodes]
            for r in range(s.rounds):
                opened = [n.begin_round(r) for n in nodes]
                for node, o, curve in zip(nodes, opened, curves):
                    result = node.finish_round(r, o)
                    if result is None:
                        raise RuntimeError(f"node {node.cfg.name} stopped during round {r}")
                    curve.append(_round_record(result, node))
                rewards = " ".join(f"{c[-1]['reward_mean']:.3f}" for c in curves)
                say(f"{label}: round {r + 1}/{s.rounds}: rewards {rewards}")
            after = [_evaluate(node, s, evals) for node in nodes]
        finally:
            for node in nodes:
                node.close()
    return [
        _node_summary(i, temp, seed, curve, b, a)
        for i, (temp, seed, curve, b, a) in enumerate(zip(temperatures, seeds, curves, before, after))
    ]


class _BeforeEvals:
    """The untrained model's evals by (model, temperature), saved as each is made, so a run cut
    during its first rounds does not evaluate the start again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values: dict[str, dict[str, float]] = json.loads(path.read_text()) if path.exists() else {}

    def get(self, model: str, temperature: float, compute: Callable[[], dict[str, float]]) -> dict[str, float]:
        key = f"{model}@{float(temperature)}"
        if key not in self.values:
            self.values[key] = compute()
            self.path.write_text(json.dumps(self.values, indent=1))
        return self.values[key]


def _node_summary(index, temperature, seed, curve, before, after) -> dict[str, Any]:
    def mean_of(key: str, peer: bool = False) -> float | None:
        values = [(rec.get("peer") or {}).get(key) if peer else rec.get(key) for rec in curve]
        present = [v for v in values if v is not None]
        return statistics.mean(present) if present else None

    rewards = [rec["reward_mean"] for rec in curve]
    return {
        "node": index,
        "temperature": temperature,
        "seed": seed,
        "rewards": rewards,
        "cumulative_reward": sum(rewards),
        "heldout_before": before["heldout"],
        "heldout_after": after["heldout"],
        "ood_before": before["ood"],
        "ood_after": after["ood"],
        "peer_samples_used": sum(rec["peer_samples"] for rec in curve),
        "own_samples": sum(rec["own_samples"] for rec in curve),
        "offpolicy": {
            "is_weight_mean": mean_of("is_weight_mean"),
            "frac_capped": mean_of("frac_capped"),
            "frac_filtered": mean_of("frac_filtered"),
            "peer_is_weight_mean": mean_of("is_weight_mean", peer=True),
            "peer_frac_capped": mean_of("frac_capped", peer=True),
            "peer_kl_mean": mean_of("kl_mean", peer=True),
        },
        "peer_rejected_total": curve[-1].get("peer_rejected_total", {}) if curve else {},
        "losses": [rec.get("loss") for rec in curve],
    }


# ---------------------------------------------------------------------------- the bench


def _run_key(swarm: str, loss: str, share: float, seed: int) -> str:
    return f"{swarm}-{loss}-{share:g}-s{seed}"


def run_swarm_gain(
    settings: GainSettings,
    *,
    work: Path,
    out: Path | None = None,
    progress: Callable[[str], None] | None = None,
    command: str = "",
    report_only: bool = False,
) -> dict[str, Any]:
    """Every configuration x seed (isolation first), each saved under `work/runs/` as it
    finishes and skipped when already there; the summary goes to `out` (json, md, png).
    `report_only`: run nothing, summarise the runs `work` holds (a run still going, or cut)."""
    from node.bench.swarm_gain_report import summarize_gain, write_gain_report
    from node.experiment.runner import quiet_hf

    say = progress or (lambda line: None)
    runs_dir = Path(work) / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    saved = Path(work) / "settings.json"
    what = settings.model_dump(mode="json", exclude={"threads"})  # threads change the time, not the figures
    if saved.exists() and {k: v for k, v in json.loads(saved.read_text()).items() if k != "threads"} != what:
        raise ValueError(f"{work} holds runs of other settings ({saved}); pass another --work folder")
    saved.write_text(json.dumps(what, indent=1))
    evals = _evals(settings)
    before_cache = _BeforeEvals(Path(work) / "before.json")

    # Seed by seed, swarm by swarm, isolation first: a run cut short still compares like with like.
    plan = [
        (swarm, loss, share, seed)
        for seed in settings.seeds
        for swarm in settings.swarms
        for loss, share in [("alone", 0.0), *((lo, sh) for sw, lo, sh in settings.configurations() if sw == swarm)]
    ]
    started = time.perf_counter()
    with quiet_hf():
        for swarm, loss, share, seed in plan:
            key = _run_key(swarm, loss, share, seed)
            path = runs_dir / f"{key}.json"
            if report_only:
                continue
            if path.exists():
                say(f"{key}: done before, skipped")
                continue
            temps = settings.temperatures(swarm)
            seeds = [settings.node_seed(seed, i) for i in range(settings.nodes)]
            t0 = time.perf_counter()
            if loss == "alone":
                nodes = _isolation_nodes(settings, runs_dir, temps, seeds, seed, evals, before_cache, say, key)
            else:
                nodes = _run(
                    settings,
                    temperatures=temps,
                    seeds=seeds,
                    loss=loss,
                    share=share,
                    evals=evals,
                    before_cache=before_cache,
                    say=say,
                    label=key,
                )
            record = {"swarm": swarm, "loss": loss, "share": share, "seed": seed, "nodes": nodes}
            record["seconds"] = round(time.perf_counter() - t0, 1)
            path.write_text(json.dumps(record, indent=1))
            say(f"{key}: {_run_line(record)} ({record['seconds']:.0f} s)")
            if out is not None:
                write_gain_report(summarize_gain(settings, runs_dir, command), Path(out), runs_dir)
    summary = summarize_gain(settings, runs_dir, command)
    summary["this_invocation_seconds"] = round(time.perf_counter() - started, 1)
    if out is not None:
        summary["files"] = write_gain_report(summary, Path(out), runs_dir)
    return summary


def _isolation_nodes(s, runs_dir, temps, seeds, seed, evals, before_cache, say, key) -> list[dict[str, Any]]:
    """Isolation nodes are independent: each runs alone and is saved as it finishes (under
    `runs/alone/`, so a cut run resumes at the next node), and a node already run in the other
    swarm's isolation (same temperature and seed) is taken from there."""
    done = {}
    for other in SWARMS:
        path = runs_dir / f"{_run_key(other, 'alone', 0.0, seed)}.json"
        if path.exists():
            for n in json.loads(path.read_text())["nodes"]:
                done[(n["temperature"], n["seed"])] = n
    singles = runs_dir / "alone"
    singles.mkdir(exist_ok=True)
    for path in singles.glob("*.json"):
        n = json.loads(path.read_text())
        done.setdefault((n["temperature"], n["seed"]), n)
    nodes = []
    for i, (temp, node_seed) in enumerate(zip(temps, seeds)):
        if (temp, node_seed) in done:
            nodes.append(done[(temp, node_seed)] | {"node": i})
            continue
        (one,) = _run(
            s,
            temperatures=[temp],
            seeds=[node_seed],
            loss="alone",
            share=0.0,
            evals=evals,
            before_cache=before_cache,
            say=say,
            label=f"{key} node {i}",
        )
        (singles / f"T{temp:g}-seed{node_seed}.json").write_text(json.dumps(one, indent=1))
        nodes.append(one | {"node": i})
    return nodes


def _run_line(record: dict[str, Any]) -> str:
    return "  ".join(
        f"n{n['node']} T{n['temperature']:g}: cum {n['cumulative_reward']:.2f} "
        f"heldout {n['heldout_before']:.3f}->{n['heldout_after']:.3f} ood {n['ood_before']:.3f}->{n['ood_after']:.3f}"
        for n in record["nodes"]
    )
