"""A NodeStatus filled the way the round loop fills it (same calls, same order), for the API tests."""

from __future__ import annotations

import time

from node.serving.status import NodeStatus, RoundRecord

PEER_M = "12D3KooWPeerMediumModel000001"
PEER_L = "12D3KooWPeerLargeModel0000002"
MARKUP = "<img src=x onerror=alert(1)>"
#: The peers' --name, as their packets carry it: one plain, one a stranger's markup.
PEER_NAMES = {PEER_M: "medium-node", PEER_L: MARKUP}


def fill_status(status: NodeStatus, rounds: int = 3, first_bucket: int = 1000) -> NodeStatus:
    status.set(peer_id="12D3KooWThisNode", join_addrs=["/ip4/127.0.0.1/tcp/1/p2p/12D3KooWThisNode"], round_seconds=8.0)
    for i in range(rounds):
        r = first_bucket + i
        status.set_phase("generating", r, round_in_run=i + 1)
        status.round_io(bytes_published=1000 + i)
        status.set_phase("gathering", r)
        if i == 1:
            status.swarm_error("dht_timeout")
        status.reject(None, "bad_record")  # a record no peer could be named for
        status.round_io(bytes_read=2000 + 10 * i, gather_seconds=0.5 + i)
        for pid, model, reward in ((PEER_M, "tiny-m", 0.25), (PEER_L, "tiny-l", 0.75)):
            status.peer_update(
                pid,
                packets=1,
                groups_admitted=2,
                samples_admitted=8,
                last_round=r,
                last_seen=time.time(),
                name=PEER_NAMES[pid],
                model=model,
                adapter_version=f"v{i}",
            )
            status.peer_rewards(pid, [reward] * 8)
        status.reject(PEER_L, "foreign_task", f"task id {MARKUP!r} is not of task 'toy'", count=2)
        status.peer_update(PEER_M, screened={"implausible": i + 1}, trust="trusted")  # what the screen dropped so far
        status.peer_update(PEER_L, trust="probation")
        status.set_phase("training", r)
        for pid in (PEER_M, PEER_L):
            status.peer_update(pid, samples_used=4)
            status.peer_update(
                pid,
                offpolicy={
                    "is_weight_mean": 0.9 + i / 100,
                    "frac_capped": 0.01,
                    "ess": 1.2,
                    "frac_filtered": 0.125,
                    "kl_p10": 0.5,
                    "kl_p50": 1.5,
                    "kl_p90": 4.0,
                    "kl_hist": [1, 2, 3],
                },
            )
        status.record_round(
            RoundRecord(
                round=r,
                started_at=time.time(),
                seconds=2.5,
                reward_mean=0.1 * (i + 1),
                own_samples=16,
                peer_samples=8,
                peers_answered=2,
                metrics={
                    "loss": -0.5,
                    "is_weight_mean": 0.97,
                    "frac_capped": 0.02,
                    "ess": 1.1,
                    "frac_filtered": 0.0,
                    "kl_p10": 0.1,
                    "kl_p50": 0.2,
                    "kl_p90": 0.3,
                    "seconds": 0.25,
                    "grad_norm": 1.5,
                    "tokens": 200.0,
                },
            ),
            adapter_version=f"adapter{i}",
        )
    status.set_phase("generating", first_bucket + rounds, round_in_run=rounds + 1)
    return status
