"""Per-peer trust: probation for new identities, quarantine for peers that keep sending poison.

Identities are cheap (a signing key takes milliseconds to make), so a peer id earns
nothing by existing. Every peer starts on PROBATION: its samples may enter a batch only
within a small share that all not-yet-trusted peers together take (`mix_groups`). It
becomes TRUSTED after `probation_rounds` rounds in which it sent samples and the screen
dropped at most `clean_fraction` of them, AND once `trust_groups` of its groups have been
trained on. The second rule is what makes identities cost: the probation share is one
pool, so n new identities fill it n times slower each, and while trusted peers fill the
batch a newcomer earns nothing (rounds alone let any number of clean Sybils in after
`probation_rounds`, and turns then hand them most of the batch). A peer whose screened
fraction is above `quarantine_fraction` in `quarantine_after` consecutive rounds is QUARANTINED for
`quarantine_rounds` rounds: its packets are refused before they are decoded. When the
quarantine ends it starts over on probation. A trusted peer that has a bad round goes
back on probation (its clean streak starts again).

What counts as screened: the samples the screen dropped (`implausible`, `judge`), the
samples of groups refused for breaking this node's limits (impossible sampling
parameters, token ids or lengths the model cannot take), and whole packets no honest
node sends: junk that does not decode (`bad_magic`, `bad_msgpack`, `truncated`, ...), a
body that does not match its own record, another sender's packet signed as one's own
(`relayed`, `impersonation`). Stale, foreign-task, other-version or duplicate packets
are not held against a peer.

Rounds are the swarm's round numbers, so `quarantined_until` is a round.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["HOSTILE_REASONS", "PeerTrust", "TrustBook", "TrustConfig", "TrustState"]

TrustState = Literal["probation", "trusted", "quarantined"]

#: Rejection reasons that count against a peer (the screen's, and limits no honest node breaks).
HOSTILE_REASONS = frozenset(
    {
        "implausible",
        "judge",
        "impersonation",
        "vocab_mismatch",
        "bad_sampling",
        "bad_token_id",
        "empty_completion",
        "too_long",
        "nonfinite_local",
        # whole packets: another's packet under one's own key, a body its record does not name
        "relayed",
        "hash_mismatch",
        "size_mismatch",
        # bytes that do not decode (protocol.errors.ErrorCode; bad_version is an honest other release)
        "not_bytes",
        "too_large",
        "truncated",
        "bad_magic",
        "bad_flags",
        "bad_compression",
        "decompression_bomb",
        "bad_msgpack",
        "bad_schema",
        "length_mismatch",
        "bad_logprob",
        "too_many_groups",
        "too_many_completions",
        "too_many_tokens",
        "completion_too_long",
        "text_too_long",
        "bad_swarm_id",
        "bad_round",
    }
)


class TrustConfig(BaseModel):
    """The trust rules (the node's `probation_*` / `quarantine_*` settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    probation_rounds: int = Field(3, ge=0, description="Clean rounds before a new peer is trusted.")
    clean_fraction: float = Field(0.1, ge=0, le=1, description="A round is clean if at most this share was screened.")
    quarantine_fraction: float = Field(
        0.25, ge=0, le=1, description="A round is bad if more than this share was screened."
    )
    quarantine_after: int = Field(2, ge=1, description="Consecutive bad rounds that quarantine a peer.")
    quarantine_rounds: int = Field(20, ge=1, description="How many rounds a quarantine lasts.")
    trust_groups: int = Field(
        8, ge=0, description="Groups of a peer's trained on (within the probation share) before it is trusted."
    )


@dataclass
class PeerTrust:
    """What this node holds about one peer."""

    peer_id: str
    state: TrustState = "probation"
    reason: str = "new peer"
    clean_rounds: int = 0  # consecutive clean rounds (the way out of probation)
    bad_rounds: int = 0  # consecutive bad rounds (the way into quarantine)
    quarantined_until: int | None = None  # first round it is heard again
    screened: Counter[str] = field(default_factory=Counter)  # running totals, by reason
    samples: int = 0  # running total of samples offered
    groups_used: int = 0  # groups trained on since it last started probation (the volume trust needs)
    # the round being collected
    _round: int | None = None
    _offered: int = 0
    _screened: int = 0


class TrustBook:
    """Trust of every peer this node has heard from. Thread-safe; fed by admission, closed per round."""

    def __init__(self, cfg: TrustConfig | None = None) -> None:
        self.cfg = cfg or TrustConfig()
        self._peers: dict[str, PeerTrust] = {}
        self._lock = threading.Lock()

    def _peer(self, peer_id: str) -> PeerTrust:
        if peer_id not in self._peers:
            self._peers[peer_id] = (
                PeerTrust(peer_id) if self.cfg.probation_rounds else PeerTrust(peer_id, "trusted", "no probation")
            )
        return self._peers[peer_id]

    # ------------------------------------------------------------------ reading
    def get(self, peer_id: str) -> PeerTrust:
        with self._lock:
            return self._peer(peer_id)

    def peers(self) -> list[PeerTrust]:
        with self._lock:
            return list(self._peers.values())

    def quarantine_reason(self, peer_id: str, round_: int) -> str | None:
        """Why `peer_id`'s packets for `round_` are refused unread, or None if they are not."""
        with self._lock:
            peer = self._peers.get(peer_id)
            if peer is None or peer.state != "quarantined":
                return None
            if peer.quarantined_until is not None and round_ >= peer.quarantined_until:
                return None  # served; end_round moves it back to probation
            return f"{peer.reason} (quarantined until round {peer.quarantined_until})"

    def quarantined(self, round_: int) -> set[str]:
        """The peers whose packets are not even fetched in `round_` (what gather's exclude_peers takes)."""
        with self._lock:
            return {
                p.peer_id
                for p in self._peers.values()
                if p.state == "quarantined" and (p.quarantined_until is None or round_ < p.quarantined_until)
            }

    def served(self) -> dict[str, int]:
        """Groups trained on per peer since its probation began (mix_groups serves the least first)."""
        with self._lock:
            return {p.peer_id: p.groups_used for p in self._peers.values()}

    def trusted(self) -> set[str]:
        with self._lock:
            return {p.peer_id for p in self._peers.values() if p.state == "trusted"}

    # ------------------------------------------------------------------ writing
    def observe(self, peer_id: str, round_: int, offered: int, screened: Counter[str] | dict[str, int]) -> None:
        """Record one packet's outcome: `offered` samples, of which `screened` (by reason) were held against it."""
        hostile = {k: v for k, v in screened.items() if k in HOSTILE_REASONS and v > 0}
        with self._lock:
            peer = self._peer(peer_id)
            if peer._round != round_:
                peer._round, peer._offered, peer._screened = round_, 0, 0
            peer._offered += max(offered, sum(hostile.values()))
            peer._screened += sum(hostile.values())
            peer.samples += offered
            peer.screened.update(hostile)

    def credit(self, peer_id: str, groups: int) -> None:
        """`groups` of `peer_id`'s were trained on: the volume a peer on probation earns trust by."""
        with self._lock:
            self._peer(peer_id).groups_used += groups

    def end_round(self, round_: int) -> None:
        """Move every peer by what it sent in `round_` (peers that sent nothing keep their state)."""
        cfg = self.cfg
        with self._lock:
            for peer in self._peers.values():
                if peer.state == "quarantined":
                    if peer.quarantined_until is not None and round_ + 1 >= peer.quarantined_until:
                        peer.state, peer.reason = "probation", f"quarantine ended at round {peer.quarantined_until}"
                        peer.clean_rounds = peer.bad_rounds = peer.groups_used = 0
                        peer.quarantined_until = None
                    continue
                if peer._round != round_ or peer._offered == 0:
                    continue
                share = peer._screened / peer._offered
                if share > cfg.quarantine_fraction:
                    peer.bad_rounds += 1
                    peer.clean_rounds = 0
                    if peer.bad_rounds >= cfg.quarantine_after:
                        peer.state = "quarantined"
                        peer.quarantined_until = round_ + 1 + cfg.quarantine_rounds
                        top = ", ".join(f"{k} {v}" for k, v in peer.screened.most_common(3))
                        peer.reason = (
                            f"{peer.bad_rounds} rounds in a row with more than {cfg.quarantine_fraction:.0%} "
                            f"of its samples screened ({top})"
                        )
                    elif peer.state == "trusted":
                        peer.state, peer.reason = "probation", f"{share:.0%} of its samples screened in round {round_}"
                        peer.groups_used = 0
                    continue
                peer.bad_rounds = 0
                if share <= cfg.clean_fraction:
                    peer.clean_rounds += 1
                else:
                    peer.clean_rounds = 0
                if peer.state != "probation" or peer.clean_rounds < cfg.probation_rounds:
                    continue
                screened = f"{cfg.clean_fraction:.0%}"  # trust looks at screening only, not at off-task packets
                if peer.groups_used < cfg.trust_groups:
                    peer.reason = (
                        f"{peer.clean_rounds} clean rounds; {peer.groups_used} of {cfg.trust_groups} groups trained on"
                    )
                    continue
                trained = f"{peer.groups_used} groups trained on"
                peer.state = "trusted"
                peer.reason = f"{peer.clean_rounds} rounds with at most {screened} screened, {trained}"
