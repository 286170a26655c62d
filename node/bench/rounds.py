"""Round-overhead benchmark: what a node's round costs beyond generation, gather and the step.

A real `Node` (the daemon's own round loop, its trainer and hf engine) plays rounds on
an in-process exchange of its own: it generates (every completion exactly `max_tokens`
long, EOS ignored, so the batch has a fixed shape), re-scores, encodes and publishes its
packet, gathers (no peers answer, and the gather's deadline is 0), builds the batch,
takes the F-TIS step, hands the new weights to the engine and, every
`checkpoint_every` rounds, writes a durable checkpoint. The instance's
`engine.generate`, `swarm.gather` and `trainer.step` are wrapped with timers (the calls
themselves are unchanged), so for each round

    overhead = round wall time - generate - gather - step

is everything else: scoring, packet encoding, publishing, batch building, the weight
hand-over into the engine, the adapter version, the checkpoint's snapshot when one is
due and any wait for its write (the write runs in the background during the next round,
timed as `checkpoint_write_s`), the status file (the named parts are also timed on their
own). One warm-up round is played first (the engine's first weight load injects the
adapter); then `rounds` rounds are timed, one of which writes a checkpoint. The figure is what a node pays per round:

    round_overhead_s = median overhead of the rounds without a checkpoint
                       + the checkpoint's cost to the loop / checkpoint_every (the node's default, 10)

(the median, because on a shared machine a few rounds catch other processes' bursts;
`mean_overhead_s` and the raw figures are reported too). A peer's packet would add its
admission (decode and re-score), which this figure does not include.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_round_overhead", "solo_node"]


def solo_node(data_dir: Path, name: str, **settings: Any) -> Any:
    """A set-up `Node` on an in-process exchange of its own: no DHT, no API, no wait for peers."""
    from node.config import NodeConfig
    from node.daemon import Node
    from node.experiment.exchange import ExchangeHub

    cfg = NodeConfig(name=name, data_dir=data_dir, gather_seconds=0.0, api_port=None, **settings)
    return Node(cfg, exchange=ExchangeHub().endpoint(name)).setup()


class _Timer:
    """Wraps one bound method of one object; sums the wall and CPU seconds spent in it since `take()`."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds = self.cpu_seconds = 0.0
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.process_time() - cpu

        setattr(owner, name, timed)

    def take(self) -> tuple[float, float]:
        out = (self.seconds, self.cpu_seconds)
        self.seconds = self.cpu_seconds = 0.0
        return out


def run_round_overhead(
    model: str | Path,
    mode: str,
    *,
    prompts: int = 4,
    group_size: int = 4,
    max_tokens: int = 64,
    rounds: int = 10,
    checkpoint_every: int | None = None,
    lora_rank: int = 8,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Play 1 + `rounds` rounds of a solo node in `mode` ("lora" or "full"); see the module docstring.

    `checkpoint_every`: the cadence the checkpoint's cost is spread over (None: the
    node's default, `NodeConfig.checkpoint_every`).
    """
    from node.config import NodeConfig

    if mode not in ("lora", "full"):
        raise ValueError(f"mode must be lora or full, got {mode!r}")
    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (one with a checkpoint, one without), got {rounds}")
    checkpoint_every = checkpoint_every or NodeConfig.model_fields["checkpoint_every"].default
    say = progress or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="ftis-bench-rounds-") as tmp:
        node = solo_node(
            Path(tmp) / "node",
            f"bench-{mode}",
            model=str(model),
            task="toy",
            train_mode=mode,
            lora_rank=lora_rank,
            prompts_per_round=prompts,
            group_size=group_size,
            max_tokens=max_tokens,
            seed=seed,
            checkpoint_every=rounds,  # the last timed round writes one
        )
        # Every completion runs to max_tokens, so each round's batch has the step bench's
        # shape (prompts x group_size x max_tokens) whatever the model says.
        node.sampling = node.sampling.model_copy(update={"ignore_eos": True})
        try:
            timers = {
                "generate": _Timer(node.engine, "generate"),
                "gather": _Timer(node.swarm, "gather"),
                "step": _Timer(node.trainer, "step"),
                "checkpoint": _Timer(node.trainer, "checkpoint_job"),  # the snapshot, on the round's path
                "checkpoint_wait": _Timer(node.checkpoints, "wait"),  # a round held for the write before it
                "engine_load": _Timer(node.engine, "load_state" if node.engine.loads_state else "load_adapter"),
                "status_file": _Timer(node, "_write_status_file"),
                "packet": _Timer(node, "_packet_bytes"),
            }
            per_round: list[dict[str, float]] = []
            for r in range(rounds + 1):
                say(f"{mode}: round {r}/{rounds}" + (" (warm-up)" if r == 0 else ""))
                start, cpu = time.perf_counter(), time.process_time()
                node.finish_round(r, node.begin_round(r))
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                taken = {name: t.take() for name, t in timers.items()}
                parts = {name: w for name, (w, _) in taken.items()}
                parts["wall"] = wall
                parts["overhead"] = wall - parts["generate"] - parts["gather"] - parts["step"]
                parts["other"] = parts["overhead"] - sum(parts[k] for k in ("engine_load", "status_file", "packet"))
                # The same in CPU seconds of this process: what other load on the machine barely
                # moves (but a checkpoint's wait for the disk is not in it).
                parts["step_cpu"] = taken["step"][1]
                parts["checkpoint_cpu"] = taken["checkpoint"][1]
                parts["overhead_cpu"] = cpu - sum(taken[k][1] for k in ("generate", "gather", "step"))
                if r > 0:
                    per_round.append(parts)
            node.checkpoints.wait()
            write_s = node.checkpoints.last_write_s
            n_params = sum(p.numel() for p in node.trainer.model.parameters())
            trainable = sum(p.numel() for p in node.trainer.params)
        finally:
            node.close()

    plain = [p for p in per_round if p["checkpoint"] == 0] or per_round
    written = sum(p["checkpoint"] > 0 for p in per_round)
    # What the checkpoint costs the loop: its snapshot plus any wait for the write (the write
    # itself, `checkpoint_write_s`, runs in the background during the next round).
    checkpoint_s = sum(p["checkpoint"] + p["checkpoint_wait"] for p in per_round) / written if written else 0.0

    def med(key: str, rows: list[dict[str, float]] = per_round) -> float:
        return statistics.median(p[key] for p in rows)

    per_round_s = med("overhead", plain)
    overhead = per_round_s + checkpoint_s / checkpoint_every
    step = med("step")
    written_cpu = [p["checkpoint_cpu"] for p in per_round if p["checkpoint"] > 0]
    checkpoint_cpu = statistics.median(written_cpu) if written_cpu else 0.0  # the snapshot
    overhead_cpu = med("overhead_cpu", plain) + checkpoint_cpu / checkpoint_every
    return {
        "mode": mode,
        "model": str(model),
        "n_params": n_params,
        "trainable_params": trainable,
        "rounds": rounds,
        "checkpoint_every": checkpoint_every,
        "checkpoints_in_rounds": written,
        "prompts": prompts,
        "group_size": group_size,
        "max_tokens": max_tokens,
        "round_overhead_s": overhead,
        "step_s": step,
        "overhead_vs_step": overhead / step,
        "cpu": {
            "round_overhead_s": overhead_cpu,
            "step_s": med("step_cpu"),
            "overhead_vs_step": overhead_cpu / med("step_cpu"),
            "checkpoint_s": checkpoint_cpu,
        },
        "per_round_overhead_s": per_round_s,
        "checkpoint_s": checkpoint_s,
        "checkpoint_per_round_s": checkpoint_s / checkpoint_every,
        "checkpoint_write_s": write_s,
        "mean_overhead_s": statistics.mean(p["overhead"] for p in per_round),
        "generate_s": med("generate"),
        "round_s": med("wall"),
        "engine_load_s": med("engine_load", plain),
        "status_file_s": med("status_file", plain),
        "packet_encode_s": med("packet", plain),
        "other_overhead_s": med("other", plain),
        # The same rounds with a checkpoint written in the round, every round (before checkpoint_every).
        "overhead_if_checkpoint_every_round_s": per_round_s + write_s,
        "raw_overhead_s": [p["overhead"] for p in per_round],
        "raw_step_s": [p["step"] for p in per_round],
    }
