"""The log-prob step, chunked (now) against one pass (before the memory cuts), timed interleaved.

    python -m node.bench.step_ab MODEL [REPEATS] [KEEP_SCORES_POSITIONS]

A LoRA trainer's `sequence_logprobs` forward and backward over 4 random prompts of 32 tokens
and completions of 64, one thread, CPU seconds; the two paths alternate (ABBA) so a busy
neighbour slows both alike. Prints one JSON line: the medians and their ratio. `KEEP` overrides
how many positions keep their softmax for the backward pass (0: every chunk rebuilt).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch


def main(argv: list[str]) -> None:
    import node.train.logprobs as logprobs
    from node.bench.memory import random_qwen_folder
    from node.models.cache import models_dir
    from node.models.registry import model_folder, resolve_model
    from node.train.trainer import Trainer, TrainerConfig

    name, repeats = argv[0], int(argv[1]) if len(argv) > 1 else 6
    if len(argv) > 2:
        logprobs.KEEP_SCORES_POSITIONS = int(argv[2])
    torch.set_num_threads(1)
    random_model = name.endswith("-random")
    folder = str(random_qwen_folder(name, models_dir())) if random_model else model_folder(resolve_model(name))
    trainer = Trainer(folder, TrainerConfig(mode="lora"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, trainer.vocab_size, 32).tolist() for _ in range(4)]
    completions = [rng.integers(2, trainer.vocab_size, 64).tolist() for _ in range(4)]
    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(repeats):
        for chunked in (True, False) if rep % 2 == 0 else (False, True):
            trainer.model.zero_grad(set_to_none=True)
            start = time.process_time()
            logp, mask = logprobs.sequence_logprobs(
                trainer.model, prompts, completions, 0.7, 0, 1.0, pad_id=trainer.pad_id, chunked=chunked
            )
            (logp * mask).sum().backward()
            times[chunked].append(time.process_time() - start)
    chunked_s, one_pass_s = (float(np.median(times[k])) for k in (True, False))
    print(
        json.dumps(
            {
                "model": name,
                "keep_scores_positions": logprobs.KEEP_SCORES_POSITIONS,
                "chunked_s": round(chunked_s, 3),
                "one_pass_s": round(one_pass_s, 3),
                "ratio": round(chunked_s / one_pass_s, 3),
                "all": {"chunked": times[True], "one_pass": times[False]},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
