"""The node daemon: one round loop wiring engine, trainer, swarm, admission and API.

    generate own -> re-score -> publish -> gather -> admit -> F-TIS step
                 -> new weights into the engine -> (every k rounds) checkpoint -> next round

Rounds are time buckets of the DHT clock (`round_at`); there is no coordinator and
no barrier: a node that finishes early waits for the next bucket, a node that is late
publishes into the current one. Without a swarm (`ftis-node train`) the same loop
runs on own samples only and does not wait for buckets.

Weights reach the engine every round without touching the disk where the engine allows
it (the hf engine copies the trainer's tensors in place; vLLM reads a weights-only
folder). A durable checkpoint (weights, optimizer, RNG, hashes) is written every
`checkpoint_every` rounds and at stop, so a crash loses at most that many rounds; a
resume says how many it lost.

Stopping: SIGINT/SIGTERM set a flag that the loop reads between phases, so a step in
progress is finished or abandoned cleanly; a final checkpoint is written if anything
was trained since the last one, and the DHT is shut down (no orphan p2pd).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from node.admission import Admission
from node.config import NodeConfig
from node.groups import SELF, ScoredGroup, ScoredSequence, mix_groups, to_packet, to_train_batch
from node.status import NodeStatus, RoundRecord

logger = logging.getLogger(__name__)


@dataclass
class RoundResult:
    round: int
    reward_mean: float
    own_samples: int
    peer_samples: int
    peers_answered: int
    seconds: float
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class OpenRound:
    """A round between `begin_round` and `finish_round`."""

    round: int
    started_at: float
    own: list[ScoredGroup] = field(default_factory=list)


class Node:
    """One participant. `run()` blocks until `rounds` are done or a stop is requested."""

    def __init__(self, cfg: NodeConfig, *, use_swarm: bool = True, exchange=None, on_round=None, on_ready=None) -> None:
        """`exchange`: an object with the `Swarm` packet API to use instead of starting a DHT
        (the in-process exchange of `ftis-node experiment`)."""
        self.cfg = cfg
        self.use_swarm = use_swarm and exchange is None
        self.on_round = on_round  # callback(RoundResult), e.g. the CLI's progress line
        self.on_ready = on_ready  # callback(Node) once the swarm and API are up
        self.status = NodeStatus(name=cfg.name, model=cfg.model, task=cfg.task, loss=cfg.loss)
        self._stop = threading.Event()
        self.swarm = exchange
        self.api = None
        self.engine = None
        self.trainer = None
        self.round_done: int | None = None
        self._dirty = False  # trained since the last checkpoint
        self._rounds_unsaved = 0  # rounds played since the last durable checkpoint

    # ------------------------------------------------------------------ set-up
    def setup(self) -> Node:
        from node.models import model_folder, resolve_model, tokenizer_fingerprint
        from node.rollout import Sampling, make_engine
        from node.tasks import get_task
        from node.train.ftis import LossConfig
        from node.train.trainer import Trainer, TrainerConfig

        cfg = self.cfg
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        self.task = get_task(cfg.task)
        if self.use_swarm:  # first, so a bad --swarm fails before minutes of model loading
            self._start_swarm()
        self.status.set_phase("loading model")
        self.model_path = model_folder(resolve_model(cfg.model))
        variant = "f-tis" if cfg.loss == "alone" else cfg.loss
        loss = LossConfig(
            variant=variant,
            is_cap=cfg.is_cap,
            kl_reduction=cfg.kl_reduction,
            **({"kl_threshold": cfg.kl_threshold} if cfg.kl_threshold is not None else {}),
        )
        self.trainer = Trainer(
            self.model_path,
            TrainerConfig(
                mode=cfg.train_mode,
                lora_rank=cfg.lora_rank,
                lr=cfg.lr,
                loss=loss,
                seed=cfg.seed,
                device=cfg.device,
                dtype=cfg.dtype,
            ),
        )
        # vLLM runs its own copy of the weights: after every load it checks itself against the
        # trainer; its LoRA slots are sized for the trainer's rank.
        extra = (
            {"reference_logprobs": self._local_logprobs, "max_lora_rank": cfg.lora_rank} if cfg.engine == "vllm" else {}
        )
        self.engine = make_engine(cfg.engine, self.model_path, device=cfg.device, dtype=cfg.dtype, **extra)
        self.tokenizer = self.engine.tokenizer
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.sampling = Sampling(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens
        )
        self.ckpt_dir = cfg.node_dir / "checkpoints"
        self._resume()
        self.admission = Admission(
            task=self.task,
            tokenizer=self.tokenizer,
            fingerprint=self.fingerprint,
            swarm_id=cfg.swarm_id,
            local_logprobs=self._local_logprobs,
            cross_tokenizer=cfg.cross_tokenizer,
        )
        if cfg.api_port is not None:
            from node.api import ApiServer

            self.api = ApiServer(self.status, host=cfg.api_host, port=cfg.api_port).start()
            self.status.set(api_url=self.api.url)
        self.status.set(adapter_version=self.trainer.adapter_version, fingerprint=self.fingerprint[:16])
        self.status.set_phase("ready")
        if self.on_ready:
            self.on_ready(self)
        return self

    def _resume(self) -> None:
        """Continue from the newest checkpoint that verifies and restores; refuse to start over
        checkpoints none of which does (`NoUsableCheckpoint`), rather than train from scratch."""
        from node.train.checkpoint import load_latest

        self.cfg.node_dir.mkdir(parents=True, exist_ok=True)  # status.json lands here before any checkpoint
        ckpt = load_latest(self.ckpt_dir, restore=self.trainer.resume, strict=True)
        if ckpt is None:
            return
        self._load_engine_weights()
        self.round_done = ckpt.round
        after = [r for r in self._rounds_played() if r > ckpt.round]
        lost = (
            f"{len(after)} round(s) played after it (up to round {max(after)}) were lost"
            if after
            else "nothing played after it was lost"
        )
        logger.warning(
            "resumed from checkpoint %s (round %d, step %d, adapter %s); %s (a checkpoint every %d rounds)",
            ckpt.path.name,
            ckpt.round,
            ckpt.meta.step,
            ckpt.meta.adapter_version,
            lost,
            self.cfg.checkpoint_every,
        )
        self.status.set(
            resumed_from={
                "round": ckpt.round,
                "step": ckpt.meta.step,
                "adapter_version": ckpt.meta.adapter_version,
                "lost_rounds": len(after),
            }
        )

    def _rounds_played(self) -> list[int]:
        """The rounds the previous run recorded in status.json (none if it left no file)."""
        try:
            history = json.loads((self.cfg.node_dir / "status.json").read_text()).get("history") or []
            return [int(h["round"]) for h in history]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return []

    def _start_swarm(self) -> None:
        from node.swarm import Swarm, SwarmConfig
        from node.swarm.join import resolve_initial_peers

        cfg = self.cfg
        self.status.set_phase("joining swarm")
        node_dir = cfg.node_dir
        node_dir.mkdir(parents=True, exist_ok=True)
        self.swarm = Swarm(
            SwarmConfig(
                swarm_id=cfg.swarm_id,
                host=cfg.host,
                port=cfg.port,
                announce_maddrs=cfg.announce,
                initial_peers=resolve_initial_peers(cfg.swarm, timeout=cfg.startup_timeout),
                client_mode=cfg.client_mode,
                use_auto_relay=cfg.auto_relay,
                identity_path=node_dir / "identity.key",
                startup_timeout=cfg.startup_timeout,
                round_seconds=cfg.round_seconds,
            )
        ).start()
        self.status.set(peer_id=self.swarm.peer_id, join_addrs=self.swarm.join_addrs())

    # ------------------------------------------------------------------ the loop
    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> list[RoundResult]:
        results: list[RoundResult] = []
        try:
            while not self.stopping and not self._finished(len(results)):
                r = self._next_round()
                if r is None:
                    break
                result = self.run_round(r)
                if result is None:
                    break
                results.append(result)
                if self.on_round:
                    self.on_round(result)
        finally:
            self.close()
        return results

    def _finished(self, played: int) -> bool:
        """`rounds` counts this run's rounds in a swarm, and the total (resume included) solo."""
        if self.cfg.rounds is None:
            return False
        if self.swarm is None:
            return (self.round_done if self.round_done is not None else -1) + 1 >= self.cfg.rounds
        return played >= self.cfg.rounds

    def _next_round(self) -> int | None:
        """The round to play: the next one locally, or the current DHT time bucket."""
        if self.swarm is None:
            return 0 if self.round_done is None else self.round_done + 1
        from protocol.keys import round_at, round_start

        r = round_at(self.swarm.dht_time(), self.cfg.round_seconds)
        if self.round_done is not None and r <= self.round_done:
            r = self.round_done + 1
            self.status.set_phase("waiting for round", r)
            while not self.stopping:  # sleep in slices so a stop is seen quickly
                wait = round_start(r, self.cfg.round_seconds) - self.swarm.dht_time()
                if wait <= 0:
                    break
                time.sleep(min(wait, 0.25))
        return None if self.stopping else r

    def run_round(self, r: int) -> RoundResult | None:
        """One whole round; None if a stop was requested before training."""
        return self.finish_round(r, self.begin_round(r))

    def begin_round(self, r: int) -> OpenRound:
        """Generate and score own samples, then publish them (the half before peers answer)."""
        opened = OpenRound(round=r, started_at=time.time())
        self.status.set_phase("generating", r)
        opened.own = self.rollout(r)
        if self.swarm is not None:
            self.status.set_phase("publishing", r)
            self.swarm.publish(r, self._packet_bytes(r, opened.own))
        return opened

    def finish_round(self, r: int, opened: OpenRound) -> RoundResult | None:
        """Gather and admit peers' samples, train, checkpoint, record (the half after)."""
        own, start = opened.own, opened.started_at
        peers: list[ScoredGroup] = []
        answered = 0
        if self.swarm is not None:
            self.status.set_phase("gathering", r)
            peers, answered = self._gather(r)
        if self.stopping:
            return None
        if self.cfg.loss == "alone":
            used, left_out = list(own), len(peers)
        else:
            used, left_out = mix_groups(own, peers, self.cfg.peer_share, self._round_rng("mix", r))
        self.status.set_phase("training", r)
        metrics = self.train(used)
        self._account_peer_use(used, metrics)
        self.status.set_phase("loading weights", r)
        self._load_engine_weights()
        self.round_done = r
        self._rounds_unsaved += 1
        if self._dirty and self._rounds_unsaved >= self.cfg.checkpoint_every:
            self.status.set_phase("checkpointing", r)
            self.checkpoint(r)
        own_rewards = np.concatenate([g.rewards for g in own]) if own else np.zeros(0)
        result = RoundResult(
            round=r,
            reward_mean=float(own_rewards.mean()) if own_rewards.size else 0.0,
            own_samples=sum(len(g.sequences) for g in own),
            peer_samples=sum(len(g.sequences) for g in used if g.source != SELF),
            peers_answered=answered,
            seconds=time.time() - start,
            metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            | {"peer_groups_capped": left_out},
        )
        self.status.record_round(
            RoundRecord(
                round=r,
                started_at=start,
                seconds=round(result.seconds, 3),
                reward_mean=result.reward_mean,
                own_samples=result.own_samples,
                peer_samples=result.peer_samples,
                peers_answered=answered,
                metrics={k: float(v) for k, v in result.metrics.items()},
            ),
            adapter_version=self.trainer.adapter_version,
        )
        self._write_status_file()
        return result

    def _write_status_file(self) -> None:
        """`<data dir>/status.json`: what GET /status says, kept after the node has stopped."""
        path = self.cfg.node_dir / "status.json"
        tmp = path.with_suffix(".json.tmp")
        snapshot = self.status.snapshot() | {"history": self.status.history_dump()}
        tmp.write_text(json.dumps(snapshot, indent=1, default=str))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ phases
    def _round_rng(self, purpose: str, r: int) -> random.Random:
        """A generator that depends only on (seed, purpose, round): a resumed node draws what
        it would have drawn, and a node that mixes in peers' samples draws the same prompts
        as one that trains alone (str seeds hash with SHA-512, stable across processes)."""
        return random.Random(f"{self.cfg.seed}/{purpose}/{r}")

    def rollout(self, r: int) -> list[ScoredGroup]:
        """Answer this round's own prompts G times each and re-score with our verifier."""
        problems = self.task.sample_problems(self._round_rng("prompts", r), self.cfg.prompts_per_round)
        sampling = self.sampling.model_copy(update={"seed": (self.cfg.seed * 1_000_003 + r) % 2**31})
        prompt_ids = [self.admission.prompt_ids(p.prompt) for p in problems]
        samples = self.engine.generate(prompt_ids, n=self.cfg.group_size, sampling=sampling)
        groups = []
        for problem, ids, answers in zip(problems, prompt_ids, samples):
            group = ScoredGroup(
                source=SELF,
                task_id=problem.task_id,
                generator=self.cfg.model,
                prompt_ids=ids,
                temperature=sampling.temperature,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
            )
            for s in answers:
                reward = float(self.task.reward(problem, s.text))
                group.sequences.append(
                    ScoredSequence(list(s.token_ids), s.logprobs, reward, 1.0, s.text, s.finish_reason)
                )
            groups.append(group)
        return groups

    def _packet_bytes(self, r: int, own: list[ScoredGroup]) -> bytes:
        from protocol import PacketHeader, SamplingParams, encode

        header = PacketHeader.create(
            swarm_id=self.cfg.swarm_id,
            round=r,
            sender_peer_id=self.swarm.peer_id,
            base_model_id=self.cfg.model,
            adapter_version=self.engine.adapter_version,
            tokenizer_fingerprint=self.fingerprint,
            vocab_size=len(self.tokenizer),
        )
        params = SamplingParams(
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
            max_tokens=self.sampling.max_tokens,
        )
        return encode(to_packet(own, header, params))

    def _gather(self, r: int) -> tuple[list[ScoredGroup], int]:
        gathered = self.swarm.gather(r, deadline_s=self.cfg.gather_seconds, expect_peers=self.cfg.expect_peers)
        attributed: dict[str, int] = {}
        for peer_id, reasons in gathered.rejected_by_peer.items():
            for reason, count in reasons.items():
                self.status.reject(peer_id, str(reason), count=count)
                attributed[reason] = attributed.get(reason, 0) + count
        for reason, count in gathered.rejected.items():  # those no peer could be named for
            if count > attributed.get(reason, 0):
                self.status.reject(None, str(reason), count=count - attributed.get(reason, 0))
        for kind, count in gathered.errors.items():
            self.status.swarm_error(kind, count)
        groups: list[ScoredGroup] = []
        for item in gathered.packets:
            admitted = self.admission.admit(item.peer_id, item.data, r)
            for reason, count in admitted.rejected.items():
                self.status.reject(item.peer_id, reason, admitted.details.get(reason, ""), count=count)
            self.status.peer_update(
                item.peer_id,
                packets=1,
                groups_admitted=len(admitted.groups),
                samples_admitted=admitted.samples,
                last_round=admitted.round,
                last_seen=time.time(),
            )
            groups.extend(admitted.groups)
        return groups, len(gathered.peers)

    def train(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        """One F-TIS step on `groups`; advantages are computed within each group."""
        batch = to_train_batch(groups)
        if batch is None:
            return {}
        metrics = self.trainer.step(batch)
        self._dirty = True
        return metrics

    def _account_peer_use(self, used: list[ScoredGroup], metrics: dict[str, Any]) -> None:
        by_source = metrics.get("by_source", {})
        for g in used:
            if g.source != SELF:
                self.status.peer_update(g.source, samples_used=len(g.sequences))
        for source, stats in by_source.items():
            if source != SELF:
                self.status.peer_update(source, offpolicy=stats)

    def checkpoint(self, r: int) -> None:
        """A durable, atomic checkpoint of round `r`: weights, optimizer, RNG and hashes."""
        self.trainer.save_checkpoint(self.ckpt_dir, r, extra={"model": self.cfg.model, "task": self.cfg.task})
        self.round_done = r
        self._dirty = False
        self._rounds_unsaved = 0

    def _load_engine_weights(self) -> None:
        """Give the engine the trainer's current weights: in memory where the engine can take
        them, else through a weights-only folder rewritten each round (no optimizer, no hashes)."""
        version = self.trainer.adapter_version
        if self.engine.adapter_version == version:
            return
        if self.engine.loads_state:
            self.engine.load_state(self.trainer.published_state(), version, lora_config=self.trainer.lora_config)
            return
        import shutil

        folder = self.cfg.node_dir / "engine-weights"
        shutil.rmtree(folder, ignore_errors=True)
        self.engine.load_adapter(self.trainer.save_adapter(folder), version)

    def _local_logprobs(self, prompt_ids, completion_ids, temperature, top_k, top_p) -> np.ndarray:
        import torch

        from node.train.logprobs import sequence_logprobs

        with torch.no_grad():
            logp, _ = sequence_logprobs(
                self.trainer.model,
                [prompt_ids],
                [completion_ids],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                pad_id=self.trainer.pad_id,
            )
        return logp[0, : len(completion_ids)].float().cpu().numpy()

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Idempotent: final checkpoint if needed, then DHT, API and engine down."""
        self.status.set_phase("stopping")
        try:
            if self._dirty and self.trainer is not None and self.round_done is not None:
                self.checkpoint(self.round_done)
        finally:
            if self.swarm is not None:
                self.swarm.shutdown()
                self.swarm = None
            if self.api is not None:
                self.api.stop()
                self.api = None
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            self.status.set_phase("stopped")
            if self.cfg.node_dir.is_dir():
                self._write_status_file()


def install_stop_handlers(node: Node) -> None:
    """SIGINT/SIGTERM ask the loop to stop at the next phase; a second one exits at once."""

    def handler(signum, frame):
        if node.stopping:
            raise SystemExit(128 + signum)
        logger.warning("stopping after the current phase (signal %d); send again to exit now", signum)
        node.request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
