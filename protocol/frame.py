"""The frame around a packet's header and body, and the bounds a receiver reads it under.

A packet is `prefix | header | body` (codec.py has the whole layout); the prefix is
magic, format version, flags and the two lengths. `Limits` is what a receiver accepts,
checked before any large allocation (by codec.py for the frame, body.py for the body).
"""

from __future__ import annotations

import struct

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FLAG_ZSTD", "FORMAT_VERSION", "MAGIC", "MAX_HEADER_BYTES", "PREFIX_SIZE", "Limits"]

MAGIC = b"FTIS"
FORMAT_VERSION = 1
FLAG_ZSTD = 0x01
_PREFIX = struct.Struct("<4sBBII")  # magic, format version, flags, header length, body length
PREFIX_SIZE = _PREFIX.size
# Any valid header fits: 5 names of at most 256 characters (4 bytes each in UTF-8), a
# 64-character display name and swarm id, 4 numbers and the field names: under 6 KiB.
MAX_HEADER_BYTES = 8192


class Limits(BaseModel):
    """What a receiver accepts. Checked before any large allocation, so an oversized
    or hostile packet costs little to reject."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # 4 MiB is hivemind's default RPC message size; max_bytes bounds the packet both as
    # received and after decompression.
    max_bytes: int = Field(4 * 2**20, ge=PREFIX_SIZE)
    max_groups: int = Field(256, ge=1)
    max_completions_per_group: int = Field(128, ge=1)
    max_tokens_per_completion: int = Field(32_768, ge=1)
    max_total_tokens: int = Field(1_000_000, ge=1)
    max_text_chars: int = Field(200_000, ge=0)  # per completion
