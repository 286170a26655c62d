"""A dishonest swarm peer in its own process: a real DHT peer that publishes, once per round,
a well-formed, correctly signed packet whose task id, model and sender name are HTML markup.

    python tests/bad_peer.py '<SwarmConfig as JSON>'

Prints {"event": "ready", "peer_id": ...} (or {"event": "error", ...}), then one
{"event": "published", "round": r, "ok": bool} per round, until SIGINT or SIGTERM.
"""

from __future__ import annotations

import json
import os
import sys
import time

MARKUP = "<img src=x onerror=alert(1)>"
MODEL = "<b>evil-model</b>"
NAME = "<i>evil</i> peer"  # its --name, as its header carries it


def bad_packet(peer_id: str, swarm_id: str, round_: int) -> bytes:
    import numpy as np

    from protocol import Completion, Group, PacketHeader, RolloutPacket, SamplingParams, encode

    header = PacketHeader.create(
        swarm_id=swarm_id,
        round=round_,
        sender_peer_id=peer_id,
        sender_name=NAME,
        base_model_id=MODEL,
        tokenizer_fingerprint="not-a-real-tokenizer",
        vocab_size=512,
    )
    completions = [Completion.of([5, 6, 7], np.full(3, -0.5, np.float32), text="<answer>1</answer>")] * 2
    group = Group.of(MARKUP, MODEL, SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=8), completions)
    return encode(RolloutPacket(header=header, groups=[group]))


def main() -> None:
    out = os.fdopen(os.dup(1), "w", buffering=1)  # our replies own the real stdout
    os.dup2(2, 1)

    def reply(**message) -> None:
        out.write(json.dumps(message) + "\n")

    from node.swarm import Swarm, SwarmConfig, SwarmStartError, install_sigterm_handler

    config = SwarmConfig.model_validate_json(sys.argv[1])
    try:
        swarm = Swarm(config).start()
    except SwarmStartError as e:
        reply(event="error", message=str(e))
        return
    install_sigterm_handler(swarm.shutdown)
    reply(event="ready", peer_id=swarm.peer_id)
    last = None
    try:
        while True:
            r = swarm.current_round()
            if r != last:
                reply(
                    event="published",
                    round=r,
                    ok=swarm.publish(r, bad_packet(swarm.peer_id, config.swarm_id, r), model=MODEL),
                )
                last = r
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        swarm.shutdown()


if __name__ == "__main__":
    main()
