"""The one exception the wire protocol raises, and its machine-readable reason codes.

A node treats bad input from the network as data: it rejects the packet, counts
the rejection by `ProtocolError.code` and shows `ProtocolError.reason` on the
dashboard. Keeping the codes in one closed enum lets the node pre-register one
counter per code.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

__all__ = ["ErrorCode", "ProtocolError"]


class ErrorCode(StrEnum):
    """Short, stable reason codes. A StrEnum, so `err.code == "bad_magic"` holds."""

    NOT_BYTES = "not_bytes"  # decode was given something other than a bytes-like object
    TOO_LARGE = "too_large"  # over Limits.max_bytes, on the wire or after decompression
    TRUNCATED = "truncated"  # shorter than its own prefix/header says
    BAD_MAGIC = "bad_magic"  # not an ftis packet at all
    BAD_VERSION = "bad_version"  # unsupported format version or protocol version
    BAD_FLAGS = "bad_flags"  # unknown flag bits set
    BAD_COMPRESSION = "bad_compression"  # corrupt zstd frame, trailing bytes, unknown size
    DECOMPRESSION_BOMB = "decompression_bomb"  # zstd frame declares more than max_bytes
    BAD_MSGPACK = "bad_msgpack"  # not valid msgpack, or bytes after the message
    BAD_SCHEMA = "bad_schema"  # wrong types, missing/extra fields, out-of-range values
    LENGTH_MISMATCH = "length_mismatch"  # arrays or counts that disagree
    BAD_TOKEN_ID = "bad_token_id"  # a token id >= vocab_size
    BAD_LOGPROB = "bad_logprob"  # a non-finite or positive log-prob
    TOO_MANY_GROUPS = "too_many_groups"
    TOO_MANY_COMPLETIONS = "too_many_completions"  # in one group
    TOO_MANY_TOKENS = "too_many_tokens"  # in the whole packet
    COMPLETION_TOO_LONG = "completion_too_long"
    TEXT_TOO_LONG = "text_too_long"
    BAD_SWARM_ID = "bad_swarm_id"
    BAD_ROUND = "bad_round"


class ProtocolError(ValueError):
    """A packet (or key) was rejected; `reason` says why in words, `code` in one token.

    Subclasses ValueError so that, raised inside a pydantic validator, it becomes an
    ordinary validation error.
    """

    def __init__(self, reason: str, *, code: ErrorCode | str) -> None:
        self.code = ErrorCode(code)  # an unknown code is a programming error: ValueError
        self.reason = reason
        super().__init__(reason)

    def __repr__(self) -> str:
        return f"ProtocolError(code={self.code.value!r}, reason={self.reason!r})"

    def __reduce__(self) -> tuple[Callable[[str, str], ProtocolError], tuple[str, str]]:
        # keep it picklable across process boundaries (DHT child)
        return (_rebuild, (self.reason, self.code.value))


def _rebuild(reason: str, code: str) -> ProtocolError:
    return ProtocolError(reason, code=code)
