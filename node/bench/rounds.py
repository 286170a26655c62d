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
hand-over into the engine, the adapter version, the checkpoint when one is due, the
status file (the named parts are also timed on their own). One warm-up round is played
first (the engine's first weight load injects the adapter); then `rounds` rounds are
timed, with `checkpoint_every = rounds`, so the timed rounds hold exactly one
checkpoint and their MEAN overhead is its cost spread over the cadence, as a node pays
it. A peer's packet would add its admission (decode and
re-score), which this figure does not include.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_round_overhead"]


class _Timer:
    """Wraps one bound method of one object; sums the seconds spent in it since `take()`."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds = 0.0
        self.calls = 0
        inner = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        setattr(owner, name, timed)

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run_round_overhead(
    model: str | Path,
    mode: str,
    *,
    prompts: int = 4,
    group_size: int = 4,
    max_tokens: int = 64,
    rounds: int = 10,
    lora_rank: int = 8,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Play 1 + `rounds` rounds of a solo node in `mode` ("lora" or "full"); see the module docstring."""
    from node.config import NodeConfig
    from node.daemon import Node
    from node.experiment.exchange import ExchangeHub

    if mode not in ("lora", "full"):
        raise ValueError(f"mode must be lora or full, got {mode!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    say = progress or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="ftis-bench-rounds-") as tmp:
        cfg = NodeConfig(
            name=f"bench-{mode}",
            data_dir=Path(tmp) / "node",
            model=str(model),
            task="toy",
            train_mode=mode,
            lora_rank=lora_rank,
            prompts_per_round=prompts,
            group_size=group_size,
            max_tokens=max_tokens,
            seed=seed,
            gather_seconds=0.0,
            checkpoint_every=rounds,
            api_port=None,
        )
        node = Node(cfg, exchange=ExchangeHub().endpoint("bench")).setup()
        # Every completion runs to max_tokens, so each round's batch has the step bench's
        # shape (prompts x group_size x max_tokens) whatever the model says.
        node.sampling = node.sampling.model_copy(update={"ignore_eos": True})
        try:
            timers = {
                "generate": _Timer(node.engine, "generate"),
                "gather": _Timer(node.swarm, "gather"),
                "step": _Timer(node.trainer, "step"),
                "checkpoint": _Timer(node.trainer, "save_checkpoint"),
                "engine_load": _Timer(node.engine, "load_state" if node.engine.loads_state else "load_adapter"),
                "status_file": _Timer(node, "_write_status_file"),
                "packet": _Timer(node, "_packet_bytes"),
            }
            per_round: list[dict[str, float]] = []
            for r in range(rounds + 1):
                say(f"{mode}: round {r}/{rounds}" + (" (warm-up)" if r == 0 else ""))
                start = time.perf_counter()
                node.finish_round(r, node.begin_round(r))
                wall = time.perf_counter() - start
                parts = {name: t.take() for name, t in timers.items()}
                parts["wall"] = wall
                parts["overhead"] = wall - parts["generate"] - parts["gather"] - parts["step"]
                if r > 0:
                    per_round.append(parts)
            n_params = sum(p.numel() for p in node.trainer.model.parameters())
            trainable = sum(p.numel() for p in node.trainer.params)
        finally:
            node.close()

    def med(key: str) -> float:
        return statistics.median(p[key] for p in per_round)

    overhead = statistics.mean(p["overhead"] for p in per_round)
    checkpoint_s = sum(p["checkpoint"] for p in per_round)
    step = med("step")
    written = [p["checkpoint"] for p in per_round if p["checkpoint"] > 0]
    return {
        "mode": mode,
        "model": str(model),
        "n_params": n_params,
        "trainable_params": trainable,
        "rounds": rounds,
        "checkpoint_every": rounds,
        "checkpoints_in_rounds": len(written),
        "prompts": prompts,
        "group_size": group_size,
        "max_tokens": max_tokens,
        "round_overhead_s": overhead,
        "step_s": step,
        "overhead_vs_step": overhead / step,
        "generate_s": med("generate"),
        "round_s": med("wall"),
        "engine_load_s": med("engine_load"),
        "checkpoint_s": written[0] if written else 0.0,
        "checkpoint_per_round_s": checkpoint_s / len(per_round),
        "status_file_s": med("status_file"),
        "packet_encode_s": med("packet"),
        "other_overhead_s": statistics.mean(
            p["overhead"] - p["engine_load"] - p["checkpoint"] - p["status_file"] - p["packet"] for p in per_round
        ),
        # What the same rounds would cost with a checkpoint every round (the old cadence).
        "overhead_if_checkpoint_every_round_s": overhead
        - checkpoint_s / len(per_round)
        + (written[0] if written else 0.0),
        "raw_overhead_s": [p["overhead"] for p in per_round],
        "raw_step_s": [p["step"] for p in per_round],
    }
