"""`protocol` must stay importable without torch (dashboards, relays, third-party clients)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import protocol
from protocol import Completion, Group, PacketHeader, RolloutPacket, SamplingParams
from protocol import decode, encode, peek_header

header = PacketHeader.create(swarm_id="s", round=1, sender_peer_id="p", base_model_id="m",
                             tokenizer_fingerprint="f", vocab_size=151646)
packet = RolloutPacket(header=header, groups=[Group.of("t", "m", SamplingParams(max_tokens=3),
                       [Completion.of([1, 70000, 151645], [-0.5, -1.0, 0.0])])])
for compress in (False, True):
    out = decode(encode(packet, compress=compress))
    assert out.groups[0].completions[0].token_ids.tolist() == [1, 70000, 151645]
assert peek_header(encode(packet)) == header
heavy = sorted(m for m in ("torch", "transformers", "hivemind", "node") if m in sys.modules)
print(",".join(heavy) or "clean")
print(protocol.__file__)
"""


def test_protocol_imports_without_torch() -> None:
    # A fresh interpreter: this test process may well have torch loaded already.
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    heavy, where = result.stdout.split()
    assert heavy == "clean", f"importing protocol pulled in: {heavy}"
    assert Path(where).resolve() == REPO / "protocol" / "__init__.py"
