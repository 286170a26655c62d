"""ftis wire protocol: rollout packets, their binary codec and DHT key naming.

Pure Python + numpy + msgpack + pydantic (zstandard optional); never imports torch,
so a dashboard, relay or third-party client can read packets cheaply.

    from protocol import RolloutPacket, encode, decode
    data = encode(packet)            # ~4.3 bytes per token
    packet = decode(data)            # validates everything; raises ProtocolError only
"""

from protocol.codec import (
    FLAG_ZSTD,
    FORMAT_VERSION,
    LOGPROB_FLOOR,
    MAGIC,
    Limits,
    decode,
    encode,
    high_bit_planes,
    peek_header,
)
from protocol.errors import ErrorCode, ProtocolError
from protocol.keys import parse_round_key, round_at, round_key, round_start, validate_swarm_id
from protocol.packet import (
    LOGPROB_TOLERANCE,
    MAX_DISPLAY_NAME_CHARS,
    PROTOCOL_VERSION,
    Completion,
    FinishReason,
    Group,
    PacketHeader,
    RolloutPacket,
    SamplingParams,
)

__all__ = [
    "FLAG_ZSTD",
    "FORMAT_VERSION",
    "LOGPROB_FLOOR",
    "LOGPROB_TOLERANCE",
    "MAGIC",
    "MAX_DISPLAY_NAME_CHARS",
    "PROTOCOL_VERSION",
    "Completion",
    "ErrorCode",
    "FinishReason",
    "Group",
    "Limits",
    "PacketHeader",
    "ProtocolError",
    "RolloutPacket",
    "SamplingParams",
    "decode",
    "encode",
    "high_bit_planes",
    "parse_round_key",
    "peek_header",
    "round_at",
    "round_key",
    "round_start",
    "validate_swarm_id",
]
