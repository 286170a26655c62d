"""The node daemon: one round loop wiring engine, trainer, swarm, admission and API.

    generate own -> re-score -> publish -> gather -> admit -> F-TIS step
                 -> new weights into the engine -> (every k rounds) checkpoint -> next round

Rounds are time buckets of the DHT clock (`round_at`); there is no coordinator and
no barrier: a node that finishes early waits for the next bucket, a node that is late
publishes into the current one. Without a swarm (`ftis-node train`) the same loop
runs on own samples only and does not wait for buckets.

Weights reach the engine every round without touching the disk where the engine allows
it (the hf engine copies the trainer's tensors in place; vLLM reads a weights-only
folder). A durable checkpoint (weights, optimizer, RNG, hashes) is written after the first
trained round (so a young node can be exported), every `checkpoint_every` rounds and at
stop, so a crash loses at most that many rounds; a resume says how many it lost. A round's
checkpoint is written in a background thread from a snapshot of the state, while the next
round runs.

Stopping: SIGINT/SIGTERM set a flag that the loop reads between phases, so a step in
progress is finished or abandoned cleanly; a final checkpoint is written if anything
was trained since the last one, and the DHT is shut down (no orphan p2pd).
"""

from __future__ import annotations

import inspect
import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from node import notices, restart, round_clock
from node.blame import step_blaming_peers
from node.checkpointing import CheckpointSchedule
from node.config import NodeConfig
from node.defence.intake import PeerIntake
from node.groups import (
    ScoredGroup,
    drop_copies,
    has_signal,
    mix_groups,
    own_groups,
    to_packet,
)
from node.local_model import LocalModel
from node.memory import release_memory
from node.rounds import OpenRound, RoundResult
from node.seeds import identity_seed, round_rng
from node.serving.status import NodeStatus
from protocol.keys import round_start

if TYPE_CHECKING:
    from node.rollout.base import RolloutEngine
    from node.serving.api import ApiServer
    from node.train.trainer import Trainer

logger = logging.getLogger(__name__)


class Node:
    """One participant. `run()` blocks until `rounds` are done or a stop is requested."""

    def __init__(self, cfg: NodeConfig, *, use_swarm: bool = True, exchange=None, on_round=None, on_ready=None) -> None:
        """`exchange`: an object with the `Swarm` packet API to use instead of starting a DHT
        (the in-process exchange of `ftis-node experiment`)."""
        self.cfg = cfg
        self.use_swarm = use_swarm and exchange is None
        self.on_round = on_round  # callback(RoundResult), e.g. the CLI's progress line
        self.on_ready = on_ready  # callback(Node) once the swarm and API are up
        self.status = NodeStatus(name=cfg.name, model=cfg.model, task=cfg.task or "", loss=cfg.loss)
        self.status.set(swarm_id=cfg.swarm_id if self.use_swarm else None)
        self._stop = threading.Event()
        self.swarm = exchange
        self.api: ApiServer | None = None
        self.engine: RolloutEngine | None = None
        self.trainer: Trainer | None = None
        self.round_done: int | None = None
        self.rounds_played = 0  # rounds begun in this run
        self.reward_faults = notices.RewardFaults()
        self.saves: CheckpointSchedule | None = None  # node/checkpointing.py

    # ------------------------------------------------------------------ set-up
    def setup(self) -> Node:
        from node.models import model_folder, resolve_model, tokenizer_fingerprint
        from node.tasks import get_task, with_rewards
        from node.train.trainer import Trainer

        cfg = self.cfg
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        given_task = get_task(cfg.task) if cfg.task is not None else None  # a bad spec fails before the load
        if self.use_swarm:  # first, so a bad --swarm fails before minutes of model loading
            self._start_swarm()
        self._resolve_seed()  # before the trainer, which seeds its initialisation with it
        self.status.set_phase("loading model")
        self.model_path = model_folder(resolve_model(cfg.model))
        self.trainer = Trainer(self.model_path, cfg.trainer_config())  # loss and trainer settings, as validated
        self.local = LocalModel(self.trainer)  # what our model thinks of any tokens: the screen's and vLLM's check
        self.engine = _make_engine(cfg, self.model_path, self.trainer, self.local)
        self.tokenizer = self.engine.tokenizer
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        # Instruct models (a chat template) get their own defaults; flags given win.
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        self.generation = cfg.generation(has_template)
        self.task = given_task if given_task is not None else get_task(self.generation.task)
        self.task = with_rewards(self.task, cfg.reward, cfg.reward_weights)  # --reward: the user's functions score
        self.status.set(task=self.generation.task)
        self.sampling = cfg.sampling(has_template)
        self.ckpt_dir = cfg.node_dir / "checkpoints"
        extra = {"model": cfg.model, "task": self.generation.task}
        self.saves = CheckpointSchedule(self.trainer, self.ckpt_dir, cfg.checkpoint_every, extra)
        self.checkpoints = self.saves.writer  # round checkpoints are written in the background
        self._resume()
        self.intake = PeerIntake.build(
            cfg,
            task=self.task,
            tokenizer=self.tokenizer,
            fingerprint=self.fingerprint,
            local=self.local,
            trainer=self.trainer,
            chat_template=self.generation.chat_template,
            status=self.status,
        )
        self.admission, self.trust = self.intake.admission, self.intake.trust
        if cfg.api_port is not None:
            from node.serving.api import ApiServer

            self.api = ApiServer(self.status, host=cfg.api_host, port=cfg.api_port).start()
            self.status.set(api_url=self.api.url)
        if self.swarm is not None:  # the dashboard's round countdown
            self.status.set(round_seconds=cfg.round_seconds, gather_seconds=cfg.gather_seconds)
        self.status.set(adapter_version=self.trainer.adapter_version, fingerprint=self.fingerprint[:16])
        self.status.set_phase("ready")
        if self.on_ready:
            self.on_ready(self)
        return self

    def _resume(self) -> None:
        """Continue from the newest checkpoint that verifies and restores; refuse to start over
        checkpoints none of which does (`NoUsableCheckpoint`), rather than train from scratch."""
        from node.train.checkpoint import load_latest

        assert self.trainer is not None and self.saves is not None, "setup() makes them first"
        self.cfg.node_dir.mkdir(parents=True, exist_ok=True)  # status.json lands here before any checkpoint
        ckpt = load_latest(self.ckpt_dir, restore=self.trainer.resume, strict=True)
        played = restart.rounds_played(self.cfg.node_dir)
        if ckpt is None:
            if fresh := restart.started_fresh(self.ckpt_dir, played, self.cfg.checkpoint_every):
                logger.warning(fresh[0])
                self.status.set(started_fresh=fresh[1], notices=[fresh[0]])
            return
        self._load_engine_weights()
        self.saves.has_one = True
        self.round_done = ckpt.round
        line, resumed_from = restart.resumed(ckpt, played, self.cfg.checkpoint_every)
        logger.warning(line)
        self.status.set(resumed_from=resumed_from)

    def _resolve_seed(self) -> None:
        """`--seed` if given, else one from this node's identity (node/seeds.py)."""
        if self.cfg.seed is None:
            seed, peer_id = identity_seed(self.swarm, self.cfg.node_dir)
            self.cfg = self.cfg.model_copy(update={"seed": seed})
            self.status.set(seed=seed)
            logger.info("seed %d, from this node's identity %s", seed, peer_id)

    def _start_swarm(self) -> None:
        from node.swarm.join import join_swarm

        self.status.set_phase("joining swarm")
        self.swarm = join_swarm(self.cfg)
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
            if results and not self.stopping and self.swarm is not None:
                self._serve_last_packet(results[-1].round)
        finally:
            self.close()
        return results

    def _serve_last_packet(self, r: int) -> None:
        """After its last round, keep the DHT up while peers may still fetch round r's body."""
        wait = round_clock.last_packet_wait(r, self.swarm.dht_time(), self.cfg.round_seconds)
        if wait > 0:
            self.status.set_phase("serving last packet", r, until=time.time() + wait)
            end = time.monotonic() + wait
            round_clock.sleep_until(lambda: end - time.monotonic(), lambda: self.stopping)

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
        now = self.swarm.dht_time()
        r = round_clock.current_round(now, self.cfg.round_seconds, self.round_done)
        start = round_start(r, self.cfg.round_seconds)
        if start > now:
            self.status.set_phase(
                "waiting for round", r, round_in_run=self.rounds_played + 1, starts_at=time.time() + start - now
            )
            round_clock.sleep_until(lambda: start - self.swarm.dht_time(), lambda: self.stopping)
        return None if self.stopping else r

    def run_round(self, r: int) -> RoundResult | None:
        """One whole round; None if a stop was requested before training."""
        return self.finish_round(r, self.begin_round(r))

    def begin_round(self, r: int) -> OpenRound:
        """Generate and score own samples, then publish them (the half before peers answer)."""
        self.rounds_played += 1
        opened = OpenRound(round=r, started_at=time.time(), round_in_run=self.rounds_played)
        self.status.set_phase("generating", r, round_in_run=self.rounds_played)
        opened.own = self.rollout(r)
        release_memory()  # generation's cache and step scores go back to the system before training
        if self.swarm is not None:
            assert self.engine is not None, "setup() made it"
            self.status.set_phase("publishing", r)
            packet = self._packet_bytes(r, opened.own)
            self.swarm.publish(r, packet, model=self.cfg.model, adapter_version=self.engine.adapter_version)
            self.status.round_io(bytes_published=len(packet))
        return opened

    def finish_round(self, r: int, opened: OpenRound) -> RoundResult | None:
        """Gather and admit peers' samples, train, checkpoint, record (the half after)."""
        assert self.trainer is not None and self.saves is not None, "setup() made them"
        own, start = opened.own, opened.started_at
        peers: list[ScoredGroup] = []
        answered, foreign = 0, (0, "")
        if self.swarm is not None:
            deadline = time.time() + self.cfg.gather_seconds

            def answered_so_far(n: int) -> None:
                self.status.set_phase("gathering", r, deadline=deadline, peers=n)

            answered_so_far(0)
            intake = self.intake.gather(
                self.swarm,
                r,
                deadline_s=self.cfg.gather_seconds,
                expect_peers=self.cfg.expect_peers,
                on_progress=answered_so_far,
            )
            answered, foreign = intake.answered, (intake.foreign, intake.foreign_why)
            peers, copies = drop_copies(own, intake.groups)
            for g in copies:
                self.status.reject(g.source, "copy_of_own", "the same prompt and completions as ours", len(g.sequences))
        if self.stopping:
            return None
        if self.cfg.loss == "alone":
            used, left_out = list(own), len(peers)
        else:
            used, left_out = mix_groups(
                own,
                peers,
                self.cfg.peer_share,
                round_rng(self.cfg.seed, "mix", r),
                trusted=self.trust.trusted(),
                probation_share=self.cfg.probation_share,
                served=self.trust.served(),
                replace=self.cfg.peer_mix == "replace",
            )
        self.status.set_phase("training", r, samples=sum(len(g.sequences) for g in used), peers=answered)
        metrics = self._train_round(used)
        release_memory()  # the step's activations and gradients, likewise before the next generation
        self.intake.account(used, metrics)
        self.status.set_phase("loading weights", r)
        self._load_engine_weights()
        self.round_done = r
        if self.saves.round_played():
            self.status.set_phase("checkpointing", r)
            self.saves.write(r, background=True)
        with_signal = sum(1 for g in used if has_signal(g))
        faults = getattr(self.task, "fault_summary", lambda: None)()  # a --reward task's bad values
        round_notices = self._notices(r, start, used, with_signal, own, foreign) + self.reward_faults.notices(faults)
        result = RoundResult.of(opened, used, answered, metrics, left_out, with_signal, round_notices)
        self.status.set(notices=round_notices)
        if faults is not None:
            self.status.set(reward_faults=faults)
        self.status.record_round(result.record(start), adapter_version=self.trainer.adapter_version)
        self._push_swarm_view()
        self._write_status_file()
        return result

    def _push_swarm_view(self) -> None:
        """Every peer the swarm layer knows of, for GET /swarm."""
        if self.swarm is None:
            return
        try:
            self.status.set_swarm_peers(list(self.swarm.known_peers()), current_round=self.round_done)
        except Exception as e:  # a view for people: never worth a round
            logger.debug("known_peers failed: %r", e)

    def _notices(self, r: int, start: float, used: list[ScoredGroup], with_signal: int, own, foreign) -> list:
        """Warnings for the console and /status (node/notices.py): nothing to learn from, peers on
        another task (`foreign`: their groups rejected this round and one reason), a long round."""
        out = [notices.no_signal(own)] if used and with_signal == 0 else []
        if foreign[0]:
            out.append(notices.foreign_task(*foreign))
        if self.swarm is not None and (
            late := notices.overrun_of(r, start, self.swarm.dht_time(), self.cfg, self.status)
        ):
            out.append(late)
        return out

    def _write_status_file(self) -> None:
        """`<data dir>/status.json`: what GET /status says, kept after the node has stopped."""
        self.status.write_file(self.cfg.node_dir / "status.json")

    # ------------------------------------------------------------------ phases
    def rollout(self, r: int) -> list[ScoredGroup]:
        """Answer this round's own prompts G times each and re-score with our verifier."""
        assert self.engine is not None and self.cfg.seed is not None, "setup() made the engine and chose the seed"
        problems = self.task.sample_problems(round_rng(self.cfg.seed, "prompts", r), self.cfg.prompts_per_round)
        sampling = self.sampling.model_copy(update={"seed": (self.cfg.seed * 1_000_003 + r) % 2**31})
        prompt_ids = [self.admission.prompt_ids(p.prompt) for p in problems]
        total = len(prompt_ids)
        self.status.set_phase("generating", r, done=0, total=total)
        progress = {}
        if "on_progress" in inspect.signature(self.engine.generate).parameters:  # the hf engine reports batches
            progress["on_progress"] = lambda done: self.status.set_phase("generating", r, done=done, total=total)
        samples = self.engine.generate(prompt_ids, n=self.cfg.group_size, sampling=sampling, **progress)
        return own_groups(problems, prompt_ids, samples, self.task, self.cfg.model, sampling)

    def _packet_bytes(self, r: int, own: list[ScoredGroup]) -> bytes:
        from protocol import PacketHeader, encode

        assert self.engine is not None, "setup() made it"
        header = PacketHeader.create(
            swarm_id=self.cfg.swarm_id,
            round=r,
            sender_peer_id=self.swarm.peer_id,
            sender_name=self.cfg.name,
            base_model_id=self.cfg.model,
            adapter_version=self.engine.adapter_version,
            tokenizer_fingerprint=self.fingerprint,
            vocab_size=len(self.tokenizer),
        )
        return encode(to_packet(own, header, self.sampling))

    def _train_round(self, used: list[ScoredGroup]) -> dict[str, Any]:
        """One F-TIS step on `used`, retried without the peers whose data breaks it (node/blame.py)."""
        assert self.trainer is not None and self.saves is not None, "setup() made them"
        steps = self.trainer.steps
        metrics, lost, trouble = step_blaming_peers(self.trainer, used)
        for peer, n in lost.items():
            self.status.reject(peer, "untrainable", trouble, count=n)
        if lost:
            logger.warning("dropped the groups of %s this round: %s", ", ".join(lost), trouble)
        self.saves.dirty |= self.trainer.steps != steps
        return metrics

    def _load_engine_weights(self) -> None:
        load_into_engine(self.trainer, self.engine, self.cfg.node_dir / "engine-weights")

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Idempotent: final checkpoint if needed, then DHT, API and engine down."""
        self.status.set_phase("stopping")
        try:
            if self.saves is not None:
                self.saves.final(self.round_done)
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


def _make_engine(cfg: NodeConfig, model_path, trainer, local: LocalModel):
    from node.rollout import make_engine

    # vLLM runs its own copy of the weights: after every load it checks itself against the
    # trainer; its LoRA slots are sized for the trainer's rank.
    extra = {"reference_logprobs": local.logprobs, "max_lora_rank": cfg.lora_rank} if cfg.engine == "vllm" else {}
    if cfg.engine == "hf":  # one copy of the weights: the trainer's (a LoRA's frozen base, or the live full model)
        extra = {"share_with": trainer.model, "max_batch_sequences": cfg.generate_batch_size()}
    return make_engine(cfg.engine, model_path, device=cfg.device, dtype=cfg.dtype, **extra)


def load_into_engine(trainer, engine, folder) -> None:
    """Give the engine the trainer's current weights: in memory where the engine can take
    them, else through a weights-only folder rewritten each round (no optimizer, no hashes)."""
    version = trainer.adapter_version
    if engine.adapter_version == version:
        return
    if engine.loads_state:
        engine.load_state(trainer.published_state(), version, lora_config=trainer.lora_config)
        return
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    engine.load_adapter(trainer.save_adapter(folder), version)


def install_stop_handlers(node: Node) -> None:
    """SIGINT/SIGTERM ask the loop to stop at the next phase; a second one exits at once."""

    def handler(signum, frame):
        if node.stopping:
            raise SystemExit(128 + signum)
        logger.warning("stopping after the current phase (signal %d); send again to exit now", signum)
        node.request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
