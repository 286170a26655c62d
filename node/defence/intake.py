"""A round's peer intake: gather the peers' packets, admit each, and count what happened on
the status and in the trust book. What the round trains on comes out; every rejection, by
peer and reason, stays behind on the dashboard."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from node.config import NodeConfig
from node.defence.admission import Admission
from node.defence.trust import TrustBook
from node.groups import SELF, ScoredGroup
from node.serving.status import NodeStatus
from protocol import Limits, PacketHeader

logger = logging.getLogger(__name__)


@dataclass
class Intake:
    groups: list[ScoredGroup] = field(default_factory=list)
    answered: int = 0  # peers whose packet arrived
    foreign: int = 0  # groups of another task (a peer on the wrong --task)
    foreign_why: str = ""  # one such rejection's reason


class PeerIntake:
    def __init__(self, admission: Admission, trust: TrustBook, status: NodeStatus) -> None:
        self.admission, self.trust, self.status = admission, trust, status

    @classmethod
    def build(
        cls, cfg: NodeConfig, *, task, tokenizer, fingerprint: str, local, trainer, chat_template, status: NodeStatus
    ) -> PeerIntake:
        """Admission with the node's screens and a trust book, as `cfg` asks (docs/security.md)."""
        trust = TrustBook(cfg.trust_config)
        admission = Admission(
            task=task,
            tokenizer=tokenizer,
            fingerprint=fingerprint,
            swarm_id=cfg.swarm_id,
            local_view=local.views,
            vocab_size=min(len(tokenizer), trainer.vocab_size),
            max_positions=trainer.max_positions,
            screens=_screens(cfg, tokenizer, status),
            claim_margin=cfg.claim_margin,
            claim_floor=cfg.screen_logprob_floor,  # no claim below the floor on a token we flag
            cut_tails=cfg.screen,  # --no-screen turns every content defence off (bench attack's baseline)
            trust=trust,
            cross_tokenizer=cfg.cross_tokenizer,
            chat_template=chat_template,
            limits=Limits(max_bytes=cfg.max_packet_bytes),  # the swarm's packet limit too: one limit
        )
        return cls(admission, trust, status)

    def gather(
        self, swarm, r: int, *, deadline_s: float, expect_peers: int | None, on_progress: Callable[[int], None]
    ) -> Intake:
        """Round r's packets from `swarm` (a `Swarm` or the experiment's exchange), admitted."""
        # Quarantined peers: Admission.admit refuses their packets unread; the swarm does not even fetch them.
        gathered = swarm.gather(
            r,
            deadline_s=deadline_s,
            expect_peers=expect_peers,
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
        intake = Intake(answered=len(gathered.peers))
        for item in gathered.packets:
            self._admit(intake, item.peer_id, item.data, r)
        self.trust.end_round(r)
        self._show_trust()
        return intake

    def _admit(self, intake: Intake, peer_id: str, data: bytes, r: int) -> None:
        try:
            admitted = self.admission.admit(peer_id, data, r)
        except Exception as err:  # admission never raises by design; if it does, one packet is lost
            logger.exception("admission failed on a packet from %s", peer_id)
            self.status.reject(peer_id, "admission_error", f"{type(err).__name__}: {err}")
            return
        for reason, count in admitted.rejected.items():
            self.status.reject(peer_id, reason, admitted.details.get(reason, ""), count=count)
        if n := admitted.rejected.get("foreign_task", 0):
            intake.foreign, intake.foreign_why = intake.foreign + n, admitted.details["foreign_task"]
        self.status.peer_update(
            peer_id,
            packets=1,
            groups_admitted=len(admitted.groups),
            samples_admitted=admitted.samples,
            tail_tokens_cut=admitted.tail_tokens_cut,
            last_round=admitted.round,
            last_seen=time.time(),
            **_claims(admitted.header),
        )
        self.status.peer_rewards(peer_id, [s.reward for g in admitted.groups for s in g.sequences])
        intake.groups.extend(admitted.groups)

    def account(self, used: list[ScoredGroup], metrics: dict[str, Any]) -> None:
        """After the step: what each peer's groups gave, on its dashboard row and as trust (volume)."""
        by_source = metrics.get("by_source", {})
        for g in used:
            if g.source != SELF:
                self.status.peer_update(g.source, samples_used=len(g.sequences))
                self.trust.credit(g.source, 1)
        for source, stats in by_source.items():
            if source != SELF:
                self.status.peer_update(source, offpolicy=stats)

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


def _screens(cfg: NodeConfig, tokenizer, status: NodeStatus) -> list:
    """The screening stages of admission, cheapest first."""
    from node.defence.screen import PlausibilityScreen

    screens: list = [PlausibilityScreen(cfg.screen_config)] if cfg.screen else []
    if cfg.judge_model:
        from node.defence.judge import JudgeScreen, ModelJudge

        status.set_phase("loading judge")
        judge = ModelJudge(cfg.judge_model, device=cfg.device)
        screens.append(JudgeScreen(judge, tokenizer.decode, cfg.judge_threshold))
    return screens


def _claims(header: PacketHeader | None) -> dict[str, str]:
    """The name, model and adapter version a header claims, for the dashboard (unverified)."""
    if header is None:  # no readable header: admission has counted the reason already
        return {}
    return {"name": header.sender_name, "model": header.base_model_id, "adapter_version": header.adapter_version}
