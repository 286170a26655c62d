"""The runs of `ftis-node experiment`: pairs of nodes x loss variants x seeds, in lockstep.

One run is two `node.daemon.Node`s on a shared in-process exchange (`exchange.py`). Each
round both nodes first generate and publish (`begin_round`), then both gather, admit,
train one step and reload their engine (`finish_round`), so each trains on the packet
its partner generated in the same round, exactly as two nodes of a swarm with
synchronised rounds. Every `eval_every` rounds (and before the first) each node's greedy
pass@1 is measured on fixed in-distribution and out-of-distribution sets.

Within one seed every variant starts from the same weights, draws its prompts from the
same seeded stream and samples with the same seeds, so variants differ only by the loss
(and, from round 1 on, by what the loss has done to the weights). Alone included: the
prompts, the sampling seed and the batch mix each draw from a generator seeded by (seed,
purpose, round) alone (`node.seeds.round_rng`), so mixing nothing changes no one's prompts.

`dht_check` repeats one short setting through real hivemind DHTs (`node.swarm.Swarm`, two
DHT processes on 127.0.0.1) and next to an in-process run of the same setting, and
records whether the two agree: the packets are the same bytes, so they should be equal.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from node.config import LOSS_CHOICES, NodeConfig
from node.tasks import TASK_KINDS
from node.train.ftis import VARIANTS

__all__ = [
    "BUILTIN_PAIRS",
    "DEFAULT_VARIANTS",
    "ExperimentConfig",
    "NodeSpec",
    "PairSpec",
    "load_experiment_config",
    "resolve_config",
    "run_experiment",
    "run_pair",
]

DEFAULT_VARIANTS: tuple[str, ...] = ("alone", *VARIANTS)  # the baseline first, then the loss variants
# What a round record keeps from the trainer's metrics (the rest stays in the node's status).
ROUND_METRICS = (
    "loss",
    "frac_filtered",
    "is_weight_mean",
    "frac_capped",
    "kl_mean",
    "kl_p90",
    "ess_kish",
    "grad_norm",
    "peer_groups_capped",
)
# ... and from the per-peer off-policy stats of the samples admitted from the partner.
PEER_METRICS = ("kl_mean", "kl_p90", "kl_max", "frac_kl_over", "frac_capped", "mean_abs_delta", "is_weight_mean")


class NodeSpec(BaseModel):
    """One member of a pair."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Model alias, local folder or hub id, as for `ftis-node join --model`.")
    train_mode: Literal["lora", "full"] = "lora"
    label: str | None = Field(None, description="Name in tables and plots [default: the model, + mode if needed].")


class PairSpec(BaseModel):
    """Two heterogeneous nodes that train together."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][\w.\-]*$")
    nodes: tuple[NodeSpec, NodeSpec]

    @model_validator(mode="after")
    def _unique_labels(self) -> PairSpec:
        a, b = self.labels
        if a == b:
            raise ValueError(f"pair {self.name!r}: both nodes are labelled {a!r}; give them distinct labels")
        return self

    @property
    def labels(self) -> tuple[str, str]:
        """Labels for reports: the given ones, else the model names (with the mode when they clash)."""
        x, y = self.nodes
        if x.label and y.label:
            return x.label, y.label
        same = x.model == y.model
        auto = [n.model + (f" ({n.train_mode})" if same else "") for n in self.nodes]
        return x.label or auto[0], y.label or auto[1]


def _pair(name: str, a: NodeSpec, b: NodeSpec) -> PairSpec:
    return PairSpec(name=name, nodes=(a, b))


#: The toy pairs of the paper's three kinds of heterogeneity.
BUILTIN_PAIRS: dict[str, PairSpec] = {
    # model size: two sizes that share one tokenizer
    "size": _pair("size", NodeSpec(model="tiny-s"), NodeSpec(model="tiny-l")),
    # expertise: one architecture warm-started on different halves of the task
    "expertise": _pair("expertise", NodeSpec(model="tiny-m:add"), NodeSpec(model="tiny-m:sub")),
    # PEFT: the same model trained in full by one node and through LoRA by the other
    "full-lora": _pair(
        "full-lora", NodeSpec(model="tiny-m", train_mode="full"), NodeSpec(model="tiny-m", train_mode="lora")
    ),
}


def _check_task_spec(spec: str, what: str) -> str:
    """Syntax only: file-backed tasks are opened when the experiment starts, not when it is read."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} is empty; e.g. toy, toy:ood, gsm8k:/data/gsm8k.jsonl")
    kind = spec.strip().partition(":")[0]
    if kind not in TASK_KINDS:
        raise ValueError(f"{what} {spec!r} has an unknown kind {kind!r}; valid kinds: {', '.join(TASK_KINDS)}")
    return spec.strip()


class ExperimentConfig(BaseModel):
    """Everything an experiment needs; the defaults are the CPU toy comparison (about 15 min on 2 cores)."""

    model_config = ConfigDict(extra="forbid")

    pairs: list[PairSpec] = Field(default_factory=lambda: [BUILTIN_PAIRS["size"]], min_length=1)
    variants: list[str] = Field(default_factory=lambda: list(DEFAULT_VARIANTS), min_length=1)
    seeds: list[int] = Field(default_factory=lambda: [0, 1], min_length=1)
    rounds: int = Field(60, ge=1, description="Training rounds (one F-TIS step each) per run.")
    eval_every: int = Field(10, ge=1, description="Evaluate every this many rounds (and before the first).")
    eval_problems: int = Field(128, ge=1, description="Problems per evaluation split.")
    eval_seed: int = Field(0, description="Seed of the evaluation problem sets.")
    task: str = Field("toy", description="Training task spec (each node's own prompts).")
    eval_tasks: dict[str, str] = Field(
        default_factory=lambda: {"id": "toy", "ood": "toy:ood"},
        min_length=1,
        description="Split label -> task spec of an evaluation set.",
    )
    prompts_per_round: int = Field(8, ge=1)
    group_size: int = Field(8, ge=2, description="G, completions per prompt.")
    max_tokens: int = Field(12, ge=1, description="Most completion tokens when training.")
    eval_max_tokens: int | None = Field(None, ge=1, description="Most tokens when evaluating [default: max_tokens].")
    temperature: float = Field(1.0, gt=0)
    # At the trainer's defaults (2e-4 LoRA, 1e-6 full) the tiny models do not move within a
    # CPU budget: 60 rounds at 2e-4 (and at 1e-3) gave the same rewards as 1e-8. These rates
    # make the policies move, so the variants can differ (sweep in docs/reproduction.md).
    lr_lora: float | None = Field(2e-3, gt=0, description="Learning rate of LoRA nodes (None: the trainer's 2e-4).")
    lr_full: float | None = Field(
        1e-4, gt=0, description="Learning rate of full fine-tuning nodes (None: the trainer's 1e-6)."
    )
    # Bounds of these and of swarm_id are the nodes' own: `_nodes_accept` builds each node's
    # NodeConfig, so a value a node would refuse is refused here, under its experiment key.
    lora_rank: int = 8
    is_cap: float = Field(2.0, description="C, the cap of the truncated IS weight.")
    kl_threshold: float | None = Field(None, description="g [default: 50 for sum, 0.5 for mean].")
    kl_reduction: Literal["sum", "mean"] = "sum"
    peer_share: float = Field(0.5, ge=0, le=1)
    engine: Literal["hf", "vllm"] = "hf"
    device: str = Field("cpu", description="Where each node's trainer and engine run (cuda on GPUs).")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    swarm_id: str = "experiment"
    dht_check: bool = Field(False, description="Also run one short setting through real DHTs and compare.")
    dht_rounds: int = Field(3, ge=1, description="Rounds of the DHT check.")
    dht_variant: str = Field("f-tis", description="Variant of the DHT check (its pair is the first pair).")

    @field_validator("pairs", mode="before")
    @classmethod
    def _builtin_pairs(cls, value: Any) -> Any:
        if isinstance(value, (str, dict, PairSpec)):
            value = [value]
        out = []
        for item in value:
            if isinstance(item, str):
                if item not in BUILTIN_PAIRS:
                    raise ValueError(
                        f"unknown pair {item!r}; built-in pairs: {', '.join(BUILTIN_PAIRS)}, "
                        "or give {name, nodes: [{model, train_mode}, {model, train_mode}]}"
                    )
                item = BUILTIN_PAIRS[item]
            out.append(item)
        return out

    @field_validator("variants", "seeds", mode="before")
    @classmethod
    def _listify(cls, value: Any) -> Any:
        return [value] if isinstance(value, (str, int)) else list(value)

    @field_validator("variants")
    @classmethod
    def _known_variants(cls, value: list[str]) -> list[str]:
        out = [v.strip().lower() for v in value]
        for v in out:
            if v not in LOSS_CHOICES:
                raise ValueError(f"unknown variant {v!r}; use some of: {', '.join(LOSS_CHOICES)}")
        if len(set(out)) != len(out):
            raise ValueError(f"variants repeat: {out}")
        return out

    @field_validator("dht_variant")
    @classmethod
    def _known_dht_variant(cls, value: str) -> str:
        value = value.strip().lower()
        if value not in LOSS_CHOICES:
            raise ValueError(f"unknown dht_variant {value!r}; use one of: {', '.join(LOSS_CHOICES)}")
        return value

    @field_validator("seeds")
    @classmethod
    def _unique_seeds(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value):
            raise ValueError(f"seeds repeat: {value}")
        if any(s < 0 for s in value):
            raise ValueError(f"seeds must be >= 0, got {value}")
        return value

    @field_validator("task")
    @classmethod
    def _task_syntax(cls, value: str) -> str:
        return _check_task_spec(value, "task")

    @field_validator("eval_tasks")
    @classmethod
    def _eval_syntax(cls, value: dict[str, str]) -> dict[str, str]:
        for label, spec in value.items():
            if not re.fullmatch(r"[A-Za-z0-9][\w\-]*", label):
                raise ValueError(f"eval split label {label!r} must be letters, digits, '_' or '-'")
            _check_task_spec(spec, f"eval_tasks[{label!r}]")
        return {k: v.strip() for k, v in value.items()}

    @model_validator(mode="after")
    def _unique_pairs(self) -> ExperimentConfig:
        names = [p.name for p in self.pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"pair names repeat: {names}")
        return self

    @model_validator(mode="after")
    def _nodes_accept(self) -> ExperimentConfig:
        """Every node of every pair takes these settings (one source: NodeConfig's rules)."""
        for pair in self.pairs:
            for index in range(len(pair.nodes)):
                try:
                    _node_config(self, pair, index, self.variants[0], 0, self.rounds, Path("."), "dht", [])
                except ValidationError as err:
                    first = err.errors()[0]
                    key = ".".join(str(part) for part in first["loc"]) or "settings"
                    msg = first["msg"].removeprefix("Value error, ")
                    raise ValueError(f"{key}: {msg} (pair {pair.name!r}, node {index})") from None
        return self

    def lr_for(self, mode: str) -> float | None:
        return self.lr_full if mode == "full" else self.lr_lora

    @property
    def eval_tokens(self) -> int:
        return self.eval_max_tokens or self.max_tokens

    def eval_steps(self, rounds: int | None = None) -> list[int]:
        """The training steps after which a run is evaluated: 0, every eval_every, and the last."""
        rounds = self.rounds if rounds is None else rounds
        return sorted({0, rounds, *range(self.eval_every, rounds + 1, self.eval_every)})


def load_experiment_config(path: str | Path, **overrides: Any) -> ExperimentConfig:
    """Read an experiment YAML file; `overrides` (None = not given) win over it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment config {path} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping of settings, not a {type(data).__name__}")
    data = data.get("experiment", data)  # the settings may sit under one `experiment:` key
    return ExperimentConfig(**(data | {k: v for k, v in overrides.items() if v is not None}))


def resolve_config(config: ExperimentConfig | str | Path | None = None, **overrides: Any) -> ExperimentConfig:
    """The settings of a run: `config` (a config, a YAML path, or None for the defaults)
    with the `overrides` that are not None on top. A pair named in `overrides["pairs"]`
    is the config's own pair of that name if it has one, else the built-in one."""
    overrides = {k: (list(v) if isinstance(v, tuple) else v) for k, v in overrides.items() if v is not None}
    if config is None:
        base = ExperimentConfig()
    elif isinstance(config, ExperimentConfig):
        base = config
    else:
        base = load_experiment_config(config)
    if "pairs" in overrides:
        pairs = overrides["pairs"]
        own = {p.name: p for p in base.pairs}
        pairs = [pairs] if isinstance(pairs, str) else pairs
        overrides["pairs"] = [own.get(p, p) if isinstance(p, str) else p for p in pairs]
    return ExperimentConfig(**(base.model_dump() | overrides))


# ---------------------------------------------------------------------------- one run


def _node_config(
    cfg: ExperimentConfig,
    pair: PairSpec,
    index: int,
    variant: str,
    seed: int,
    rounds: int,
    data_dir: Path,
    transport: str,
    swarm: list[str],
) -> NodeConfig:
    spec = pair.nodes[index]
    return NodeConfig(
        name=f"{pair.name}-{index}-{variant}-s{seed}",
        data_dir=data_dir,
        model=spec.model,
        task=cfg.task,
        engine=cfg.engine,
        device=cfg.device,
        dtype=cfg.dtype,
        train_mode=spec.train_mode,
        lora_rank=cfg.lora_rank,
        lr=cfg.lr_for(spec.train_mode),
        rounds=rounds,
        prompts_per_round=cfg.prompts_per_round,
        group_size=cfg.group_size,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        # Each node its own prompt stream, the same in every variant (Alone's too: the batch
        # mix draws from a generator of its own).
        seed=seed * 100 + index,
        loss=variant,
        is_cap=cfg.is_cap,
        kl_threshold=cfg.kl_threshold,
        kl_reduction=cfg.kl_reduction,
        peer_share=cfg.peer_share,
        swarm_id=cfg.swarm_id,
        swarm=swarm,
        host="127.0.0.1",
        port=0,
        gather_seconds=120.0 if transport == "dht" else 0.0,  # lockstep: the partner has already published
        expect_peers=1,
        # The pair's nodes are this experiment's own, so the partner is trusted from round 0
        # (a new peer's probation would hide it from small batches); the screen stays on.
        probation_rounds=0,
        api_port=None,
    )


def _round_record(result, node) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "round": result.round,
        "reward_mean": result.reward_mean,
        "own_samples": result.own_samples,
        "peer_samples": result.peer_samples,
        "peers_answered": result.peers_answered,
        "seconds": round(result.seconds, 3),
    }
    rec.update({k: float(result.metrics[k]) for k in ROUND_METRICS if k in result.metrics})
    peers = node.status.snapshot()["peers"]
    stats = next((p["offpolicy"] for p in peers.values() if p.get("offpolicy")), None)
    if stats and result.peer_samples:
        rec["peer"] = {k: float(stats[k]) for k in PEER_METRICS if k in stats}
    rejected: dict[str, int] = {}
    for p in peers.values():  # running totals since the run began, by reason
        for reason, count in p.get("rejected", {}).items():
            rejected[reason] = rejected.get(reason, 0) + count
    if rejected:
        rec["peer_rejected_total"] = rejected
    return rec


class _Transport:
    """Starts the two nodes of a run on one in-process hub or on two real DHTs."""

    def __init__(self, kind: str) -> None:
        if kind not in ("inproc", "dht"):
            raise ValueError(f"unknown transport {kind!r}; use inproc or dht")
        self.kind = kind

    def start(self, configs: Callable[[int, list[str]], NodeConfig]) -> list:
        from node.daemon import Node

        nodes: list = []
        try:
            if self.kind == "inproc":
                from node.experiment.exchange import ExchangeHub

                hub = ExchangeHub(configs(0, []).swarm_id)
                for i in range(2):
                    nodes.append(Node(configs(i, []), exchange=hub.endpoint(f"n{i}")).setup())
            else:
                first = Node(configs(0, []), use_swarm=True)
                nodes.append(first)
                first.setup()
                second = Node(configs(1, first.swarm.join_addrs()), use_swarm=True)
                nodes.append(second)
                second.setup()
        except BaseException:
            for n in nodes:
                n.close()
            raise
        return nodes


def run_pair(
    cfg: ExperimentConfig,
    pair: PairSpec,
    variant: str,
    seed: int,
    evals: Sequence,
    *,
    rounds: int | None = None,
    transport: str = "inproc",
    work_dir: Path | None = None,
    on_round: Callable[[int], None] | None = None,
    initial_cache: dict | None = None,
) -> dict[str, Any]:
    """One run: two nodes, `rounds` lockstep rounds, evaluations; returns its curves.

    `initial_cache` maps (model, split) to the accuracy of the untrained model, which is
    the same in every variant and seed (LoRA starts as the identity, full starts at the
    base), so it is measured once per model and split.
    """
    from node.experiment.evaluate import greedy_pass_at_1, sampled_reward_mean

    rounds = cfg.rounds if rounds is None else rounds
    steps = set(cfg.eval_steps(rounds))
    own_tmp = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="ftis-exp-")) if work_dir is None else Path(work_dir)
    started = time.perf_counter()
    try:
        nodes = _Transport(transport).start(
            lambda i, swarm: _node_config(cfg, pair, i, variant, seed, rounds, work / f"node{i}", transport, swarm)
        )
    except BaseException:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)
        raise
    # The weights a node started from: a tiny model's folder name carries its build key.
    builds = [Path(str(n.model_path)).name for n in nodes]
    # Greedy pass@1 (the paper's metric) and the mean reward of 4 samples per problem at the
    # training temperature (what RL maximises; it moves before an argmax flips).
    metrics = {e.name: (e, lambda node, e: greedy_pass_at_1(node, e, cfg.eval_tokens)) for e in evals}
    metrics |= {
        f"{e.name}-sampled": (e, lambda node, e: sampled_reward_mean(node, e, cfg.eval_tokens, 4, cfg.eval_seed))
        for e in evals
    }
    curves: list[dict[str, Any]] = [{"rounds": [], "evals": {name: [] for name in metrics}} for _ in nodes]
    eval_seconds = 0.0

    def evaluate(step: int) -> None:
        nonlocal eval_seconds
        t = time.perf_counter()
        for node, spec, curve in zip(nodes, pair.nodes, curves):
            for name, (e, measure) in metrics.items():
                key = (spec.model, name)
                if step == 0 and initial_cache is not None and key in initial_cache:
                    acc = initial_cache[key]
                else:
                    acc = measure(node, e)
                    if step == 0 and initial_cache is not None:
                        initial_cache[key] = acc
                curve["evals"][name].append([step, acc])
        eval_seconds += time.perf_counter() - t

    try:
        evaluate(0)
        for r in range(rounds):
            opened = [n.begin_round(r) for n in nodes]
            results = [n.finish_round(r, o) for n, o in zip(nodes, opened)]
            for node, res, curve in zip(nodes, results, curves):
                if res is None:
                    raise RuntimeError(f"node {node.cfg.name} stopped during round {r}")
                curve["rounds"].append(_round_record(res, node))
            if r + 1 in steps:
                evaluate(r + 1)
            if on_round:
                on_round(r)
    finally:
        for n in nodes:
            n.close()
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)
    return {
        "pair": pair.name,
        "variant": variant,
        "seed": seed,
        "transport": transport,
        "rounds": rounds,
        "seconds": round(time.perf_counter() - started, 2),
        "eval_seconds": round(eval_seconds, 2),
        "nodes": [
            {
                "label": label,
                "model": spec.model,
                "build": build,
                "train_mode": spec.train_mode,
                "seed": seed * 100 + i,
                **curve,
            }
            for i, (label, spec, build, curve) in enumerate(zip(pair.labels, pair.nodes, builds, curves))
        ],
    }


# ---------------------------------------------------------------------------- the DHT check


def _max_abs_diff(a: Iterable[float], b: Iterable[float]) -> float:
    a, b = list(a), list(b)
    if len(a) != len(b):
        return math.inf
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def compare_runs(reference: dict[str, Any], other: dict[str, Any], tolerance: float = 0.05) -> dict[str, Any]:
    """How far two runs of one setting are apart: rewards, losses and accuracies, per node."""
    per_node = []
    for a, b in zip(reference["nodes"], other["nodes"]):
        reward = _max_abs_diff((r["reward_mean"] for r in a["rounds"]), (r["reward_mean"] for r in b["rounds"]))
        loss = _max_abs_diff((r.get("loss", 0.0) for r in a["rounds"]), (r.get("loss", 0.0) for r in b["rounds"]))
        acc = max(
            _max_abs_diff((v for _, v in a["evals"][k]), (v for _, v in b["evals"].get(k, []))) for k in a["evals"]
        )
        peers = min((r["peer_samples"] for r in b["rounds"]), default=0)
        per_node.append(
            {
                "label": a["label"],
                "reward_max_abs_diff": reward,
                "loss_max_abs_diff": loss,
                "accuracy_max_abs_diff": acc,
                "min_peer_samples": peers,
            }
        )
    worst = max(max(n["reward_max_abs_diff"], n["accuracy_max_abs_diff"]) for n in per_node)
    return {
        "identical": all(
            n["reward_max_abs_diff"] == 0 and n["accuracy_max_abs_diff"] == 0 and n["loss_max_abs_diff"] < 1e-9
            for n in per_node
        ),
        "agree": worst <= tolerance and all(n["min_peer_samples"] > 0 for n in per_node),
        "tolerance": tolerance,
        "nodes": per_node,
    }


def run_dht_check(
    cfg: ExperimentConfig,
    evals: Sequence,
    *,
    on_round: Callable[[int], None] | None = None,
    initial_cache: dict | None = None,
) -> dict[str, Any]:
    """The first pair, `dht_variant`, the first seed, `dht_rounds` rounds: in-process, then over DHTs."""
    pair, seed = cfg.pairs[0], cfg.seeds[0]
    kw: dict[str, Any] = dict(rounds=cfg.dht_rounds, on_round=on_round, initial_cache=initial_cache)
    inproc = run_pair(cfg, pair, cfg.dht_variant, seed, evals, transport="inproc", **kw)
    dht = run_pair(cfg, pair, cfg.dht_variant, seed, evals, transport="dht", **kw)
    return {"inproc": inproc, "dht": dht, **compare_runs(inproc, dht)}


# ---------------------------------------------------------------------------- the experiment


def run_experiment(
    out_dir: str | Path,
    *,
    config: ExperimentConfig | str | Path | None = None,
    pairs: Sequence[str] | None = None,
    variants: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    rounds: int | None = None,
    eval_every: int | None = None,
    eval_problems: int | None = None,
    prompts_per_round: int | None = None,
    group_size: int | None = None,
    max_tokens: int | None = None,
    lr_lora: float | None = None,
    lr_full: float | None = None,
    kl_threshold: float | None = None,
    kl_reduction: str | None = None,
    dht_check: bool | None = None,
    dht_rounds: int | None = None,
    plot: bool = True,
    command: str | None = None,
    console=None,
) -> dict[str, Any]:
    """Run every pair x variant x seed, write results.json, results.md and curves.png to `out_dir`.

    `config` is an ExperimentConfig or the path of a YAML file (e.g. configs/paper-gpu.yaml);
    the keyword arguments that are not None override it. Returns the results dict (also
    in results.json); its "files" entry lists what was written. `command` is recorded
    with the results (default: this process's command line), so each figure says how it
    was made.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from node.experiment.evaluate import eval_set
    from node.experiment.report import write_report

    overrides = dict(
        pairs=pairs,
        variants=variants,
        seeds=seeds,
        rounds=rounds,
        eval_every=eval_every,
        eval_problems=eval_problems,
        prompts_per_round=prompts_per_round,
        group_size=group_size,
        max_tokens=max_tokens,
        lr_lora=lr_lora,
        lr_full=lr_full,
        kl_threshold=kl_threshold,
        kl_reduction=kl_reduction,
        dht_check=dht_check,
        dht_rounds=dht_rounds,
    )
    cfg = resolve_config(config, **overrides)

    from node.rollout import ENGINES
    from node.tasks import get_task

    if cfg.engine not in ENGINES:
        raise ValueError(f"rollout engine {cfg.engine!r} is not available yet; available: {', '.join(ENGINES)}")
    get_task(cfg.task)  # a missing data file fails here, before minutes of model loading
    evals = [eval_set(name, spec, cfg.eval_problems, cfg.eval_seed) for name, spec in cfg.eval_tasks.items()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = console or Console(stderr=True)
    grid = [(p, v, s) for p in cfg.pairs for v in cfg.variants for s in cfg.seeds]
    total = len(grid) * cfg.rounds + (2 * cfg.dht_rounds if cfg.dht_check else 0)
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    cache: dict = {}
    dht: dict[str, Any] | None = None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with quiet_hf(), Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("experiment", total=total)
        tick = lambda _r: progress.advance(bar)  # noqa: E731
        for pair, variant, seed in grid:
            progress.update(bar, description=f"{pair.name} {variant:>6} seed {seed}")
            run = run_pair(cfg, pair, variant, seed, evals, on_round=tick, initial_cache=cache)
            runs.append(run)
            progress.console.print(_run_line(run))
        if cfg.dht_check:
            progress.update(bar, description=f"DHT check ({cfg.pairs[0].name} {cfg.dht_variant})")
            dht = run_dht_check(cfg, evals, on_round=tick, initial_cache=cache)
            verdict = "identical" if dht["identical"] else ("agree" if dht["agree"] else "DISAGREE")
            progress.console.print(f"DHT check: in-process and DHT runs {verdict}")
    results = {
        "command": command if command is not None else " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": json.loads(cfg.model_dump_json()),
        "eval_sets": {e.name: {"task": cfg.eval_tasks[e.name], "problems": len(e)} for e in evals},
        "eval_steps": cfg.eval_steps(),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "runs": runs,
        "dht_check": dht,
    }
    results["files"] = write_report(results, out, plot=plot)
    console.print(f"wrote {', '.join(str(p) for p in results['files'].values())}")
    return results


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """No transformers progress bars: every round saves and loads weights, and one bar per
    save would drown the experiment's own progress line."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _run_line(run: dict[str, Any]) -> str:
    parts = []
    for n in run["nodes"]:
        accs = " ".join(f"{k} {v[-1][1]:.2f}" for k, v in n["evals"].items())
        parts.append(f"{n['label']}: {accs}")
    head = f"{run['pair']} {run['variant']:>6} seed {run['seed']}  "
    return head + "  |  ".join(parts) + f"  ({run['seconds']:.0f}s)"
