"""Bounded msgpack reading: a message's structure is checked as it is read.

`msgpack.unpackb` builds the whole object tree before the caller can look at it, so a
few bytes saying "an array of 4 million empty arrays" cost 4 million Python objects
(about 250 MiB and seconds of CPU) before a decoder could notice that a packet holds at
most 256 groups. `BoundedReader` reads one item at a time instead: the caller says what
it expects next (an array of at most n items, a map of at most n entries, a scalar, a
binary of at most n bytes), the reader checks the type byte and the declared length
BEFORE anything is built, and only scalars are ever unpacked. msgpack's own
max_*_len limits stay on underneath as a backstop.

So reading costs O(what the schema allows), never O(what the bytes claim).
"""

from __future__ import annotations

from typing import Any, Final, NoReturn

import msgpack

from protocol.errors import ErrorCode, ProtocolError

__all__ = ["SCALARS", "BoundedReader", "kind_of"]


def _kind_table() -> tuple[str, ...]:
    table = ["int"] * 256  # 0x00-0x7f positive fixint, 0xe0-0xff negative fixint
    spans = {
        "map": [(0x80, 0x8F), (0xDE, 0xDF)],
        "array": [(0x90, 0x9F), (0xDC, 0xDD)],
        "str": [(0xA0, 0xBF), (0xD9, 0xDB)],
        "nil": [(0xC0, 0xC0)],
        "invalid": [(0xC1, 0xC1)],  # never used by the format
        "bool": [(0xC2, 0xC3)],
        "bin": [(0xC4, 0xC6)],
        "ext": [(0xC7, 0xC9), (0xD4, 0xD8)],
        "float": [(0xCA, 0xCB)],
    }
    for kind, ranges in spans.items():
        for lo, hi in ranges:
            for b in range(lo, hi + 1):
                table[b] = kind
    return tuple(table)


_KIND: Final = _kind_table()
# Where the length of a str/bin/array/map sits: type byte -> size of the big-endian length
# that follows it (fix* types carry it in the type byte itself).
_LENGTH_BYTES: Final = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4, 0xDC: 2, 0xDD: 4, 0xDE: 2, 0xDF: 4}
_FIX_MASK: Final = {"map": 0x0F, "array": 0x0F, "str": 0x1F}
SCALARS: Final = frozenset({"nil", "bool", "int", "float", "str", "bin"})
_ARTICLE: Final = {"int": "an int", "array": "an array", "ext": "an ext value", "invalid": "an invalid byte"}


def kind_of(type_byte: int) -> str:
    """The msgpack type a first byte announces: int, float, str, bin, nil, bool, array, map, ext, invalid."""
    return _KIND[type_byte]


def _a(kind: str) -> str:
    return _ARTICLE.get(kind, f"a {kind}")


class BoundedReader:
    """Reads one msgpack message from `buf`, item by item, under the caller's bounds.

    Every method raises `ProtocolError` (never anything else): `bad_msgpack` for bytes
    that are not msgpack, `bad_schema` for a type other than the one expected, and the
    caller's code for a length over its bound.
    """

    __slots__ = ("_buf", "_size", "_unpacker", "_what")

    def __init__(self, buf: bytes | memoryview, what: str, *, max_str_bytes: int, max_items: int) -> None:
        self._buf = buf
        self._size = len(buf)
        self._what = what
        # The backstop: even an item unpacked by mistake cannot exceed these.
        self._unpacker = msgpack.Unpacker(
            None,
            raw=False,
            strict_map_key=True,
            max_buffer_size=max(self._size, 1),
            max_str_len=max_str_bytes,
            max_bin_len=self._size,
            max_array_len=max_items,
            max_map_len=max_items,
            max_ext_len=0,
        )
        self._unpacker.feed(buf)

    def _malformed(self, detail: str) -> NoReturn:
        raise ProtocolError(f"{self._what} is not valid msgpack: {detail}", code=ErrorCode.BAD_MSGPACK)

    def _peek(self) -> tuple[int, int, str]:
        """(offset, type byte, kind) of the next item, consuming nothing."""
        pos: int = self._unpacker.tell()
        if pos >= self._size:
            self._malformed(f"it ends after {pos} bytes, in the middle of an item")
        b = self._buf[pos]
        kind = _KIND[b]
        if kind == "invalid":
            self._malformed(f"byte 0x{b:02x} at offset {pos} is never valid")
        return pos, b, kind

    def _declared_length(self, pos: int, b: int, kind: str) -> int:
        mask = _FIX_MASK.get(kind)
        if mask is not None and b not in _LENGTH_BYTES:
            return b & mask
        size = _LENGTH_BYTES[b]
        if pos + 1 + size > self._size:
            self._malformed(f"the length of the {kind} at offset {pos} is cut off")
        return int.from_bytes(self._buf[pos + 1 : pos + 1 + size], "big")

    def _consume(self, fn: Any) -> Any:
        try:
            return fn()
        except msgpack.OutOfData:
            self._malformed("it ends in the middle of an item")
        except Exception as e:  # msgpack raises a zoo of types (FormatError, ValueError, UnicodeDecodeError, ...)
            self._malformed(f"{type(e).__name__}: {e}")

    def peek_kind(self) -> str:
        """The kind of the next item (see `kind_of`), consuming nothing."""
        return self._peek()[2]

    def container(self, kind: str, where: str, max_len: int, code: ErrorCode = ErrorCode.BAD_SCHEMA) -> int:
        """Enter an array or map of at most `max_len` items; returns its length. Its items
        (for a map: key, value, key, value, ...) are the next items to read."""
        pos, b, got = self._peek()
        if got != kind:
            raise ProtocolError(f"{where} must be {_a(kind)}, got {_a(got)}", code=ErrorCode.BAD_SCHEMA)
        n = self._declared_length(pos, b, kind)
        if n > max_len:
            raise ProtocolError(f"{where} has {n} {'entries' if kind == 'map' else 'items'}, over {max_len}", code=code)
        read = self._unpacker.read_array_header if kind == "array" else self._unpacker.read_map_header
        self._consume(read)
        return n

    def scalar(
        self,
        where: str,
        kinds: frozenset[str] = SCALARS,
        *,
        max_bytes: int | None = None,
        code: ErrorCode = ErrorCode.BAD_SCHEMA,
    ) -> Any:
        """Read one item of one of `kinds` (scalars only); a str or bin may hold at most `max_bytes`."""
        pos, b, got = self._peek()
        if got not in kinds:
            wanted = " or ".join(sorted(_a(k) for k in kinds))
            raise ProtocolError(f"{where} must be {wanted}, got {_a(got)}", code=ErrorCode.BAD_SCHEMA)
        if max_bytes is not None and got in ("str", "bin"):
            n = self._declared_length(pos, b, got)
            if n > max_bytes:
                raise ProtocolError(f"{where} is {n} bytes, over the limit of {max_bytes}", code=code)
        return self._consume(self._unpacker.unpack)

    def binary(self, where: str) -> memoryview:
        """Read one bin item as a view into the buffer (no copy: the codec's arrays are
        views of it until they are converted)."""
        pos, b, got = self._peek()
        if got != "bin":
            raise ProtocolError(f"{where} must be a bin, got {_a(got)}", code=ErrorCode.BAD_SCHEMA)
        n = self._declared_length(pos, b, got)
        start = pos + 1 + _LENGTH_BYTES[b]
        if start + n > self._size:
            self._malformed(f"the {n}-byte bin at offset {pos} is cut off")
        self._consume(self._unpacker.skip)
        return memoryview(self._buf)[start : start + n]

    def finish(self) -> None:
        """The message must end exactly here."""
        pos: int = self._unpacker.tell()
        if pos != self._size:
            self._malformed(f"{self._size - pos} unexpected bytes after the message")
