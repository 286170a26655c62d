"""The body map of a packet, read under the receiver's limits (see codec.py for the layout).

`read_body` walks the msgpack with a `BoundedReader`: the map may hold only the seven
known fields, once each; `groups` at most `max_groups` entries of exactly
`[task_id, generator_model_id, [temperature, top_p, top_k, max_tokens], n]`, each
validated as it is read; `texts` nil or at most `max_groups * max_completions_per_group`
strings of at most `4 * max_text_chars` bytes; every other field one binary. No
container is entered before its declared length is checked, so what a packet costs to
reject is bounded by the limits, not by what its bytes claim. The flat arrays are
checked against each other by the codec.
"""

from __future__ import annotations

from typing import Any, NamedTuple, NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from protocol.errors import ErrorCode, ProtocolError
from protocol.frame import Limits
from protocol.packet import MAX_NAME_CHARS, Name, SamplingParams
from protocol.reader import BoundedReader

__all__ = ["BODY_FIELDS", "SAMPLING_FIELDS", "Body", "RawGroup", "fail", "read_body", "validated"]

BODY_FIELDS = ("groups", "lengths", "finish", "texts", "ids_lo", "ids_hi", "logprobs")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens")
_GROUP_SHAPE = "[task_id, generator_model_id, [temperature, top_p, top_k, max_tokens], n]"
_STR = frozenset({"str"})
_TEXT = frozenset({"nil", "str"})
_NAME_BYTES = 4 * MAX_NAME_CHARS  # UTF-8 takes at most 4 bytes per character
_KEY_BYTES = 16  # the longest body field name has 8
_M = TypeVar("_M", bound=BaseModel)


def fail(code: ErrorCode, reason: str) -> NoReturn:
    raise ProtocolError(reason, code=code)


def validated(model: type[_M], obj: Any, what: str) -> _M:
    """`model` validated strictly (no coercion from the network); the first error becomes a `bad_schema`."""
    try:
        return model.model_validate(obj, strict=True)
    except ValidationError as e:
        first = e.errors(include_input=False, include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"]) or "value"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        fail(ErrorCode.BAD_SCHEMA, f"{what}: {loc}: {first['msg']}{more}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _GroupNames(BaseModel):
    """The two strings of a group, validated before any completion is built."""

    model_config = ConfigDict(extra="forbid")

    task_id: Name
    generator_model_id: Name


class RawGroup(NamedTuple):
    """One group as read: everything but its completions, all validated."""

    task_id: str
    generator_model_id: str
    sampling: SamplingParams
    n: int  # completions


class Body(NamedTuple):
    """The body's fields; the binary ones are views into the (decompressed) body."""

    groups: list[RawGroup]
    texts: list[str | None] | None
    lengths: memoryview
    finish: memoryview
    ids_lo: memoryview
    ids_hi: memoryview
    logprobs: memoryview


def _read_groups(r: BoundedReader, limits: Limits) -> list[RawGroup]:
    n_groups = r.container("array", "body field 'groups'", limits.max_groups, ErrorCode.TOO_MANY_GROUPS)
    groups: list[RawGroup] = []
    for gi in range(n_groups):
        where = f"group {gi}"
        if r.peek_kind() != "array" or r.container("array", where, 4) != 4:
            fail(ErrorCode.BAD_SCHEMA, f"{where} is not {_GROUP_SHAPE}")
        task_id = r.scalar(f"{where} task_id", max_bytes=_NAME_BYTES)
        generator = r.scalar(f"{where} generator_model_id", max_bytes=_NAME_BYTES)
        if r.peek_kind() != "array" or r.container("array", f"{where} sampling", 4) != 4:
            fail(ErrorCode.BAD_SCHEMA, f"{where} is not {_GROUP_SHAPE}")
        values = [r.scalar(f"{where} sampling.{name}", max_bytes=_KEY_BYTES) for name in SAMPLING_FIELDS]
        n = r.scalar(f"{where} completion count")
        if not _is_int(n) or n < 1:
            fail(ErrorCode.BAD_SCHEMA, f"{where}: completion count must be an int >= 1, got {n!r}")
        if n > limits.max_completions_per_group:
            fail(
                ErrorCode.TOO_MANY_COMPLETIONS,
                f"{where} has {n} completions, over the limit of {limits.max_completions_per_group}",
            )
        names = validated(_GroupNames, {"task_id": task_id, "generator_model_id": generator}, where)
        sampling = validated(SamplingParams, dict(zip(SAMPLING_FIELDS, values, strict=True)), f"{where} sampling")
        groups.append(RawGroup(names.task_id, names.generator_model_id, sampling, n))
    return groups


def _read_texts(r: BoundedReader, max_completions: int, max_chars: int) -> list[str | None] | None:
    kind = r.peek_kind()
    if kind == "nil":
        r.scalar("body field 'texts'")
        return None
    if kind != "array":
        fail(ErrorCode.BAD_SCHEMA, f"body field 'texts' must be nil or a list, got {kind}")
    n = r.container("array", "body field 'texts'", max_completions, ErrorCode.LENGTH_MISMATCH)
    texts: list[str | None] = []
    for i in range(n):
        # 4 bytes per character bound the bytes; the characters are counted once decoded.
        t = r.scalar(f"text of completion {i}", _TEXT, max_bytes=4 * max_chars, code=ErrorCode.TEXT_TOO_LONG)
        if t is not None and len(t) > max_chars:
            fail(
                ErrorCode.TEXT_TOO_LONG,
                f"text of completion {i} has {len(t)} characters, over the limit of {max_chars}",
            )
        texts.append(t)
    return texts


def read_body(buf: bytes | memoryview, limits: Limits) -> Body:
    """The body's fields, its structure checked as it is read; raises `ProtocolError` only."""
    max_completions = limits.max_groups * limits.max_completions_per_group
    r = BoundedReader(
        buf,
        "body",
        max_str_bytes=max(4 * limits.max_text_chars, _NAME_BYTES),
        max_items=max(max_completions, limits.max_groups, len(BODY_FIELDS)),
    )
    if r.peek_kind() != "map":
        fail(ErrorCode.BAD_SCHEMA, f"body must be a map, got {r.peek_kind()}")
    n_fields = r.container("map", "body", len(BODY_FIELDS))
    fields: dict[str, Any] = {}
    for _ in range(n_fields):
        key = r.scalar("a body field name", _STR, max_bytes=_KEY_BYTES)
        if key not in BODY_FIELDS:
            fail(ErrorCode.BAD_SCHEMA, f"unexpected body field {key!r}")
        if key in fields:
            fail(ErrorCode.BAD_SCHEMA, f"body field {key!r} appears twice")
        if key == "groups":
            fields[key] = _read_groups(r, limits)
        elif key == "texts":
            fields[key] = _read_texts(r, max_completions, limits.max_text_chars)
        else:
            fields[key] = r.binary(f"body field {key!r}")
    r.finish()
    if len(fields) != len(BODY_FIELDS):
        fail(ErrorCode.BAD_SCHEMA, f"body fields are missing: {[k for k in BODY_FIELDS if k not in fields]}")
    return Body(**fields)
