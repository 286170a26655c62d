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
import json
import logging
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from node.config import NodeConfig
from node.defence.admission import Admission
from node.groups import (
    SELF,
    ScoredGroup,
    ScoredSequence,
    drop_copies,
    has_signal,
    mix_groups,
    to_packet,
    to_train_batch,
)
from node.memory import release_memory
from node.serving.status import NodeStatus, RoundRecord
from protocol.codec import Limits

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
    round_in_run: int | None = None  # 1, 2, ... counted from this run's start (`round` is the bucket)
    notices: list[str] = field(default_factory=list)  # what the user should know about this round


@dataclass
class OpenRound:
    """A round between `begin_round` and `finish_round`."""

    round: int
    started_at: float
    own: list[ScoredGroup] = field(default_factory=list)
    round_in_run: int | None = None


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
        self.api = None
        self.engine = None
        self.trainer = None
        self.round_done: int | None = None
        self.rounds_played = 0  # rounds begun in this run
        self._dirty = False  # trained since the last checkpoint
        self._rounds_unsaved = 0  # rounds played since the last durable checkpoint
        self._reward_faults_seen = 0  # bad --reward values counted before this round
        self._has_checkpoint = False  # none yet: the first trained round writes one, so export works at once
        self.checkpoints = None  # the CheckpointWriter: round checkpoints are written in the background

    # ------------------------------------------------------------------ set-up
    def setup(self) -> Node:
        from node.models import model_folder, resolve_model, tokenizer_fingerprint
        from node.rollout import make_engine
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
        # vLLM runs its own copy of the weights: after every load it checks itself against the
        # trainer; its LoRA slots are sized for the trainer's rank.
        extra = (
            {"reference_logprobs": self._local_logprobs, "max_lora_rank": cfg.lora_rank} if cfg.engine == "vllm" else {}
        )
        if cfg.engine == "hf":  # one copy of the weights: the trainer's (a LoRA's frozen base, or the live full model)
            extra = {"share_with": self.trainer.model, "max_batch_sequences": cfg.generate_batch_size()}
        self.engine = make_engine(cfg.engine, self.model_path, device=cfg.device, dtype=cfg.dtype, **extra)
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
        from node.train.checkpoint import CheckpointWriter

        self.checkpoints = CheckpointWriter()
        self._resume()
        from node.defence.trust import TrustBook

        self.trust = TrustBook(cfg.trust_config)
        self.admission = Admission(
            task=self.task,
            tokenizer=self.tokenizer,
            fingerprint=self.fingerprint,
            swarm_id=cfg.swarm_id,
            local_view=self._local_view,
            vocab_size=min(len(self.tokenizer), self.trainer.vocab_size),
            max_positions=self.trainer.max_positions,
            screens=self._screens(),
            claim_margin=cfg.claim_margin,
            claim_floor=cfg.screen_logprob_floor,  # no claim below the floor on a token we flag
            cut_tails=cfg.screen,  # --no-screen turns every content defence off (bench attack's baseline)
            trust=self.trust,
            cross_tokenizer=cfg.cross_tokenizer,
            chat_template=self.generation.chat_template,
            limits=Limits(max_bytes=cfg.max_packet_bytes),  # the swarm's packet limit too: one limit
        )
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

    def _screens(self) -> list:
        """The screening stages of admission, cheapest first (docs/security.md)."""
        from node.defence.screen import PlausibilityScreen

        cfg = self.cfg
        screens: list = [PlausibilityScreen(cfg.screen_config)] if cfg.screen else []
        if cfg.judge_model:
            from node.defence.judge import JudgeScreen, ModelJudge

            self.status.set_phase("loading judge")
            judge = ModelJudge(cfg.judge_model, device=cfg.device)
            screens.append(JudgeScreen(judge, self.tokenizer.decode, cfg.judge_threshold))
        return screens

    def _resume(self) -> None:
        """Continue from the newest checkpoint that verifies and restores; refuse to start over
        checkpoints none of which does (`NoUsableCheckpoint`), rather than train from scratch."""
        from node.train.checkpoint import load_latest

        self.cfg.node_dir.mkdir(parents=True, exist_ok=True)  # status.json lands here before any checkpoint
        ckpt = load_latest(self.ckpt_dir, restore=self.trainer.resume, strict=True)
        if ckpt is None:
            self._say_started_fresh()
            return
        self._load_engine_weights()
        self._has_checkpoint = True
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

    def _say_started_fresh(self) -> None:
        """A restart with no checkpoint says what the earlier run played and this one lost."""
        played = self._rounds_played()
        if not played:
            return
        message = (
            f"no checkpoint in {self.ckpt_dir}: the {len(played)} round(s) the earlier run played "
            f"(up to round {max(played)}) are lost; starting fresh from the model's own weights "
            f"(a checkpoint is written every {self.cfg.checkpoint_every} rounds)"
        )
        logger.warning(message)
        self.status.set(started_fresh={"lost_rounds": len(played), "last_round": max(played)}, notices=[message])

    def _rounds_played(self) -> list[int]:
        """The rounds the previous run recorded in status.json (none if it left no file)."""
        try:
            history = json.loads((self.cfg.node_dir / "status.json").read_text()).get("history") or []
            return [int(h["round"]) for h in history]
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return []

    def _resolve_seed(self) -> None:
        """`--seed` if given, else a hash of this node's peer id: one seed on every node would
        make a swarm of copies (the same prompts, the same samples). The identity key lives in
        the data dir, so a resumed node goes on with the stream it had; a solo node makes and
        keeps a key there too."""
        if self.cfg.seed is not None:
            return
        if self.swarm is not None:
            peer_id = self.swarm.peer_id
        else:
            from node.swarm.identity import NodeIdentity

            self.cfg.node_dir.mkdir(parents=True, exist_ok=True)
            identity = NodeIdentity.acquire(self.cfg.node_dir / "identity.key")
            try:
                peer_id = identity.peer_id
            finally:
                identity.release()
        self.cfg = self.cfg.model_copy(update={"seed": seed_of_peer(peer_id)})
        self.status.set(seed=self.cfg.seed)
        logger.info("seed %d, from this node's identity %s", self.cfg.seed, peer_id)

    def _start_swarm(self) -> None:
        from node.swarm import Swarm
        from node.swarm.join import resolve_initial_peers
        from node.swarm.ledger import body_verdict

        cfg = self.cfg
        self.status.set_phase("joining swarm")
        node_dir = cfg.node_dir
        node_dir.mkdir(parents=True, exist_ok=True)
        self.swarm = Swarm(
            cfg.swarm_config(
                initial_peers=resolve_initial_peers(cfg.swarm, timeout=cfg.swarm_wait),
                identity_path=node_dir / "identity.key",
            ),
            body_check=body_verdict,  # junk and relayed copies never use up a slot or a true sender's delivery
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
            if results and not self.stopping and self.swarm is not None:
                self._serve_last_packet(results[-1].round)
        finally:
            self.close()
        return results

    def _serve_last_packet(self, r: int) -> None:
        """After its last round (--rounds), keep the DHT up while peers may still fetch round r's body.

        Peers read round r in their gathers of rounds r .. r + STALE_ROUNDS; the last of those
        ends with bucket r + STALE_ROUNDS. So the node waits until then: at most
        (1 + STALE_ROUNDS) round lengths, less if its last round ran late. A stop ends it at once.
        """
        from protocol.keys import STALE_ROUNDS, round_start

        rs = self.cfg.round_seconds
        wait = min(round_start(r + 1 + STALE_ROUNDS, rs) - self.swarm.dht_time(), (1 + STALE_ROUNDS) * rs)
        if wait <= 0:
            return
        self.status.set_phase("serving last packet", r, until=time.time() + wait)
        end = time.monotonic() + wait
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.25, max(0.0, end - time.monotonic())))

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
            self.status.set_phase(
                "waiting for round",
                r,
                round_in_run=self.rounds_played + 1,
                starts_at=time.time() + round_start(r, self.cfg.round_seconds) - self.swarm.dht_time(),
            )
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
        self.rounds_played += 1
        opened = OpenRound(round=r, started_at=time.time(), round_in_run=self.rounds_played)
        self.status.set_phase("generating", r, round_in_run=self.rounds_played)
        opened.own = self.rollout(r)
        release_memory()  # generation's cache and step scores go back to the system before training
        if self.swarm is not None:
            self.status.set_phase("publishing", r)
            packet = self._packet_bytes(r, opened.own)
            self.swarm.publish(r, packet, model=self.cfg.model, adapter_version=self.engine.adapter_version)
            self.status.round_io(bytes_published=len(packet))
        return opened

    def finish_round(self, r: int, opened: OpenRound) -> RoundResult | None:
        """Gather and admit peers' samples, train, checkpoint, record (the half after)."""
        own, start = opened.own, opened.started_at
        peers: list[ScoredGroup] = []
        answered, foreign = 0, (0, "")
        if self.swarm is not None:
            deadline = time.time() + self.cfg.gather_seconds

            def answered_so_far(n: int) -> None:
                self.status.set_phase("gathering", r, deadline=deadline, peers=n)

            answered_so_far(0)
            peers, answered, foreign = self._gather(r, answered_so_far)
            peers, copies = drop_copies(own, peers)
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
                self._round_rng("mix", r),
                trusted=self.trust.trusted(),
                probation_share=self.cfg.probation_share,
                served=self.trust.served(),
                replace=self.cfg.peer_mix == "replace",
            )
        self.status.set_phase("training", r, samples=sum(len(g.sequences) for g in used), peers=answered)
        metrics = self._train_round(used)
        release_memory()  # the step's activations and gradients, likewise before the next generation
        self._account_peer_use(used, metrics)
        self.status.set_phase("loading weights", r)
        self._load_engine_weights()
        self.round_done = r
        self._rounds_unsaved += 1
        # The previous round's checkpoint was written while this round ran; it is on disk before
        # this round is recorded as played, so a crash still loses at most checkpoint_every rounds.
        self.checkpoints.wait()
        if self._dirty and (self._rounds_unsaved >= self.cfg.checkpoint_every or not self._has_checkpoint):
            self.status.set_phase("checkpointing", r)
            self.checkpoint(r, background=True)
        own_rewards = np.concatenate([g.rewards for g in own]) if own else np.zeros(0)
        with_signal = sum(1 for g in used if has_signal(g))
        faults = getattr(self.task, "fault_summary", lambda: None)()  # a --reward task's bad values
        notices = self._notices(r, start, used, with_signal, own_rewards, foreign) + self._reward_notices(faults)
        result = RoundResult(
            round=r,
            reward_mean=float(own_rewards.mean()) if own_rewards.size else 0.0,
            own_samples=sum(len(g.sequences) for g in own),
            peer_samples=sum(len(g.sequences) for g in used if g.source != SELF),
            peers_answered=answered,
            seconds=time.time() - start,
            metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            | {"peer_groups_capped": left_out, "groups_with_signal": with_signal / len(used) if used else 0.0},
            round_in_run=opened.round_in_run,
            notices=notices,
        )
        self.status.set(notices=notices)
        if faults is not None:
            self.status.set(reward_faults=faults)
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
                round_in_run=result.round_in_run,
            ),
            adapter_version=self.trainer.adapter_version,
        )
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

    def _notices(
        self, r: int, start: float, used: list[ScoredGroup], with_signal: int, own_rewards, foreign: tuple[int, str]
    ) -> list[str]:
        """Warnings for the console and /status: nothing to learn from, peers on another task
        (`foreign`: their groups rejected this round and one reason), a long round."""
        notices = []
        if used and with_signal == 0:
            values = sorted({float(v) for v in own_rewards}) or [0.0]
            notices.append(
                f"no learning signal: all rewards equal (every sample in every group scored "
                f"{values[0]:.3g}), so this round changes nothing; an easier task, more --max-tokens or "
                "a larger --group-size gives the groups rewards that differ"
            )
        if foreign[0]:
            notices.append(
                f"{foreign[0]} peer group(s) rejected as another task ({foreign[1]}): a swarm learns "
                "together only on one task; restart with the swarm's --task (a peer's printed join line names it)"
            )
        if self.swarm is not None:
            from protocol.keys import round_at

            seconds, bucket = time.time() - start, self.cfg.round_seconds
            late = round_at(self.swarm.dht_time(), bucket) - r - 1  # buckets that passed unplayed
            if seconds > bucket or late > 0:
                from node.console.progress import overrun_advice

                skipped = f", so {late} round(s) of the swarm went by without this node" if late > 0 else ""
                advice = overrun_advice(self.status.phase_seconds(), seconds, bucket, self.cfg)
                notices.append(
                    f"this round took {seconds:.3g} s, longer than its {bucket:g} s bucket{skipped}: {advice}"
                )
        return notices

    def _reward_notices(self, faults: dict | None) -> list[str]:
        """A warning in the rounds whose --reward values were bad (they scored 0 or were clamped)."""
        total = sum(v for k, v in (faults or {}).items() if k != "last")
        new, self._reward_faults_seen = total - self._reward_faults_seen, total
        if new <= 0:
            return []
        assert faults is not None
        counts = ", ".join(f"{k} {v}" for k, v in faults.items() if k != "last")
        return [
            f"{new} --reward value(s) this round were bad and scored 0 (outside [0, 1]: clamped); "
            f"so far {counts}; last: {faults['last']}"
        ]

    def _write_status_file(self) -> None:
        """`<data dir>/status.json`: what GET /status says, kept after the node has stopped."""
        path = self.cfg.node_dir / "status.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.status.file_text())
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
        total = len(prompt_ids)
        self.status.set_phase("generating", r, done=0, total=total)
        progress = {}
        if "on_progress" in inspect.signature(self.engine.generate).parameters:  # the hf engine reports batches
            progress["on_progress"] = lambda done: self.status.set_phase("generating", r, done=done, total=total)
        samples = self.engine.generate(prompt_ids, n=self.cfg.group_size, sampling=sampling, **progress)
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
            sender_name=self.cfg.name,
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

    def _gather(self, r: int, on_progress: Callable[[int], None]) -> tuple[list[ScoredGroup], int, tuple[int, str]]:
        # Quarantined peers: Admission.admit refuses their packets unread; the swarm does not
        # even fetch them.
        gathered = self.swarm.gather(
            r,
            deadline_s=self.cfg.gather_seconds,
            expect_peers=self.cfg.expect_peers,
            exclude_peers=self.trust.quarantined(r),
            trusted_peers=self.trust.trusted(),
            on_progress=on_progress,
        )
        for peer_id, reasons in gathered.rejected_by_peer.items():  # each under the id its signing key proves
            for reason, count in reasons.items():
                self.status.reject(peer_id, str(reason), count=count)
            # Junk bodies and relayed copies count against their signer, as the screen's drops do.
            self.trust.observe(peer_id, r, 0, {str(k): v for k, v in reasons.items()})
        for kind, count in gathered.errors.items():
            self.status.swarm_error(kind, count)
        self.status.round_io(gather_seconds=gathered.elapsed_s, bytes_read=gathered.bytes_read)
        groups: list[ScoredGroup] = []
        foreign, foreign_why = 0, ""  # peer groups of another task, and one rejection's reason
        for item in gathered.packets:
            try:
                admitted = self.admission.admit(item.peer_id, item.data, r)
            except Exception as err:  # admission never raises by design; if it does, one packet is lost
                logger.exception("admission failed on a packet from %s", item.peer_id)
                self.status.reject(item.peer_id, "admission_error", f"{type(err).__name__}: {err}")
                continue
            for reason, count in admitted.rejected.items():
                self.status.reject(item.peer_id, reason, admitted.details.get(reason, ""), count=count)
            if n := admitted.rejected.get("foreign_task", 0):
                foreign, foreign_why = foreign + n, admitted.details["foreign_task"]
            self.status.peer_update(
                item.peer_id,
                packets=1,
                groups_admitted=len(admitted.groups),
                samples_admitted=admitted.samples,
                tail_tokens_cut=admitted.tail_tokens_cut,
                last_round=admitted.round,
                last_seen=time.time(),
                **_sender_model(item.data),
            )
            self.status.peer_rewards(item.peer_id, [s.reward for g in admitted.groups for s in g.sequences])
            groups.extend(admitted.groups)
        self.trust.end_round(r)
        self._show_trust()
        return groups, len(gathered.peers), (foreign, foreign_why)

    def _show_trust(self) -> None:
        for peer in self.trust.peers():
            self.status.peer_update(
                peer.peer_id,
                trust=peer.state,
                trust_reason=peer.reason,
                screened=dict(peer.screened),
                quarantined_until=None,  # replaced, not added to (peer_update adds ints)
            )
            if peer.quarantined_until is not None:
                self.status.peer_update(peer.peer_id, quarantined_until=peer.quarantined_until)

    def train(self, groups: list[ScoredGroup]) -> dict[str, Any]:
        """One F-TIS step on `groups`; advantages are computed within each group."""
        batch = to_train_batch(groups)
        if batch is None:
            return {}
        metrics = self.trainer.step(batch)
        if "skipped" in metrics:
            logger.warning("training step skipped: %s", metrics["skipped"])
            return metrics | {"step_skipped": 1}
        self._dirty = True
        return metrics

    def _train_round(self, used: list[ScoredGroup]) -> dict[str, Any]:
        """`train(used)`, except that peers' data which breaks the step costs those peers their
        groups for this round (counted as `untrainable`), never the node its round loop."""
        steps = self.trainer.steps
        try:
            metrics = self.train(used)
            trouble = metrics.get("skipped")
        except Exception as err:
            if all(g.source == SELF for g in used):
                raise  # our own samples: a bug to see, not a peer to blame
            metrics, trouble = {}, f"{type(err).__name__}: {err}"
        peers = sorted({g.source for g in used if g.source != SELF})
        if trouble is None or not peers or self.trainer.steps != steps:
            return metrics
        blamed = self._untrainable(used) or set(peers)
        for peer in blamed:
            n = sum(len(g.sequences) for g in used if g.source == peer)
            self.status.reject(peer, "untrainable", trouble, count=n)
        logger.warning("dropping the groups of %s this round: %s", ", ".join(sorted(blamed)), trouble)
        kept = [g for g in used if g.source not in blamed]
        return self.train(kept) | {"peer_groups_dropped": len(used) - len(kept)}

    def _untrainable(self, used: list[ScoredGroup]) -> set[str]:
        """The peers whose groups alone fail the trainer's checks."""
        bad = set()
        for source in {g.source for g in used if g.source != SELF}:
            try:
                batch = to_train_batch([g for g in used if g.source == source])
                if batch is not None:
                    self.trainer.check(batch)
            except Exception:
                bad.add(source)
        return bad

    def _account_peer_use(self, used: list[ScoredGroup], metrics: dict[str, Any]) -> None:
        by_source = metrics.get("by_source", {})
        for g in used:
            if g.source != SELF:
                self.status.peer_update(g.source, samples_used=len(g.sequences))
                self.trust.credit(g.source, 1)
        for source, stats in by_source.items():
            if source != SELF:
                self.status.peer_update(source, offpolicy=stats)

    def checkpoint(self, r: int, *, background: bool = False) -> None:
        """A durable, atomic checkpoint of round `r`: weights, optimizer, RNG and hashes.

        `background`: snapshot the state now and write it while the loop goes on (the
        next round waits for it before it is recorded); else write it now.
        """
        job = self.trainer.checkpoint_job(
            self.ckpt_dir, r, extra={"model": self.cfg.model, "task": self.generation.task}, snapshot=background
        )
        self.checkpoints.wait()
        if background:
            self.checkpoints.submit(job)
        else:
            job()
        self.round_done = r
        self._dirty = False
        self._rounds_unsaved = 0
        self._has_checkpoint = True

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

    def _local_view(self, prompt_ids, completions, temperature, top_k, top_p):
        """Our log-prob and rank of each token of `completions` (the screen's input): no autograd,
        and the output head a chunk of positions at a time, so no [tokens, vocab] logits stay."""
        from node.defence.screen import TokenView
        from node.train.logprobs import completion_views

        rows = completion_views(
            self.trainer.model,
            prompt_ids,
            completions,
            temperature,
            top_k,
            top_p,
            self.trainer.pad_id,
            token_budget=self.trainer.cfg.micro_batch_tokens,
        )
        return [TokenView(logp=logp, rank=rank) for logp, rank in rows]

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
            if self.checkpoints is not None:
                try:
                    self.checkpoints.wait()
                except Exception as e:  # the final checkpoint below writes it again
                    logger.error("the last background checkpoint failed: %s", e)
                    self._dirty = True
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


def seed_of_peer(peer_id: str) -> int:
    """A node's default seed: 31 bits of sha256(peer id), the same in every process."""
    import hashlib

    return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:4], "big") >> 1


def _sender_model(data: bytes) -> dict[str, str]:
    """The name, model and adapter version a packet's header claims, for the dashboard (unverified)."""
    from protocol.codec import peek_header

    try:
        header = peek_header(data)
    except Exception:  # network data; admission has counted the reason already
        return {}
    return {"name": header.sender_name, "model": header.base_model_id, "adapter_version": header.adapter_version}


def install_stop_handlers(node: Node) -> None:
    """SIGINT/SIGTERM ask the loop to stop at the next phase; a second one exits at once."""

    def handler(signum, frame):
        if node.stopping:
            raise SystemExit(128 + signum)
        logger.warning("stopping after the current phase (signal %d); send again to exit now", signum)
        node.request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
