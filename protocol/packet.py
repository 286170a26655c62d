"""The rollout packet: what one node tells the swarm about one round.

    RolloutPacket
      header: PacketHeader          who, which swarm/round, which model/tokenizer
      groups: list[Group]           one per prompt answered
        task_id, generator_model_id, sampling: SamplingParams
        completions: list[Completion]   the G answers
          token_ids (np.uint32), logprobs (np.float32), text?, finish_reason

Token ids and log-probs are held as 1-D numpy arrays, not Python lists, because a
packet carries tens of thousands of them and the codec and trainer work on arrays.
Lists are accepted and converted. Construction validates everything the decoder
validates, so a packet built here always encodes and decodes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    field_validator,
    model_validator,
)

from protocol.keys import validate_swarm_id

__all__ = [
    "LOGPROB_TOLERANCE",
    "MAX_DISPLAY_NAME_CHARS",
    "MAX_NAME_CHARS",
    "PROTOCOL_VERSION",
    "Completion",
    "FinishReason",
    "Group",
    "PacketHeader",
    "RolloutPacket",
    "SamplingParams",
    "logprob_problem",
]

PROTOCOL_VERSION = 3  # 2: the sharded DHT layout; 3: the sender's display name (CHANGELOG.md)
MAX_NAME_CHARS = 256  # bound on every identifier string (ids, hashes, fingerprints)
MAX_DISPLAY_NAME_CHARS = 64  # a node's --name: a label for people, not an identity
# Sampling log-probs are <= 0 mathematically, but an engine's float arithmetic can land a
# hair above zero for a near-certain token; that is noise, not a bad packet.
LOGPROB_TOLERANCE = 1e-4

FinishReason = Literal["stop", "length"]
_MAX_UINT32 = 2**32 - 1


def _as_token_ids(value: Any) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint32:
        return arr
    if arr.size == 0:  # np.asarray([]) is float64; an empty list is still a valid (empty) id list
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _MAX_UINT32:
        raise ValueError(f"token_ids must be in [0, 2**32), got range [{lo}, {hi}]")
    return arr.astype(np.uint32)


def _as_logprobs(value: Any) -> np.ndarray:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"logprobs must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.float32)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"logprobs must be real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float32, copy=False)
    problem = logprob_problem(arr)
    if problem:
        raise ValueError(problem)
    return arr


def logprob_problem(arr: np.ndarray) -> str | None:
    """Why `arr` is not a valid log-prob array (first non-finite or positive value), or None."""
    finite = np.isfinite(arr)
    if not finite.all():
        i = int(np.argmin(finite))
        return f"logprobs must be finite, got {arr[i]} at position {i}"
    if arr.size and float(arr.max()) > LOGPROB_TOLERANCE:
        i = int(np.argmax(arr))
        return f"logprobs must be <= 0, got {arr[i]} at position {i}"
    return None


def _to_list(arr: np.ndarray) -> list[int] | list[float]:
    out: list[int] | list[float] = arr.tolist()
    return out


def _utf8(s: str) -> str:
    # A Python str may hold lone surrogates (e.g. from errors="surrogateescape"); they
    # cannot go on the wire, so refuse them here rather than fail inside encode.
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"string is not valid unicode at position {e.start}") from None
    return s


# Arrays validate through our own functions; JSON dumps (dashboard, API) get plain lists.
TokenIds = Annotated[np.ndarray, PlainValidator(_as_token_ids), PlainSerializer(_to_list, when_used="json")]
LogProbs = Annotated[np.ndarray, PlainValidator(_as_logprobs), PlainSerializer(_to_list, when_used="json")]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_utf8)]


def _printable(s: str) -> str:
    # A stranger's label is shown on dashboards, terminals and metric labels: no control,
    # format or line-separator characters that could rewrite what is around it.
    if not s.isprintable():
        raise ValueError("display name holds a control or non-printable character")
    return s


DisplayName = Annotated[
    str, Field(max_length=MAX_DISPLAY_NAME_CHARS), AfterValidator(_utf8), AfterValidator(_printable)
]
Text = Annotated[str, AfterValidator(_utf8)]

_set = object.__setattr__  # how pydantic itself fills a frozen model in model_construct
_COMPLETION_FIELDS = ("token_ids", "logprobs", "text", "finish_reason")

_MODEL_CONFIG = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class SamplingParams(BaseModel):
    """How the completions were sampled. The receiver scores under the same temperature,
    so the recorded log-probs are those AFTER temperature (and top-k/top-p, if used)."""

    model_config = _MODEL_CONFIG

    temperature: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=_MAX_UINT32)  # 0 = off
    max_tokens: int = Field(ge=1, le=_MAX_UINT32)


class Completion(BaseModel):
    """One sampled answer: its token ids and the sampling log-prob of each token."""

    model_config = _MODEL_CONFIG

    token_ids: TokenIds
    logprobs: LogProbs
    # Only sent when the receiver may use another tokenizer and must re-tokenize.
    text: Text | None = None
    finish_reason: FinishReason = "stop"

    @model_validator(mode="after")
    def _same_length(self) -> Completion:
        if self.token_ids.size != self.logprobs.size:
            raise ValueError(f"token_ids and logprobs differ in length ({self.token_ids.size} != {self.logprobs.size})")
        return self

    @classmethod
    def of(
        cls,
        token_ids: Any,
        logprobs: Any,
        *,
        text: Text | None = None,
        finish_reason: FinishReason = "stop",
    ) -> Completion:
        """Positional shorthand: `Completion.of([5, 9], [-0.1, -2.3])`."""
        return cls(token_ids=token_ids, logprobs=logprobs, text=text, finish_reason=finish_reason)

    @classmethod
    def trusted(cls, token_ids: np.ndarray, logprobs: np.ndarray, text: str | None, finish_reason: str) -> Completion:
        """A Completion of values already validated (the decoder checks them vectorized).

        What `model_construct` does for this model, without its generic per-field loop:
        a quarter of the cost, and decode builds one per completion.
        """
        m = cls.__new__(cls)
        values = {"token_ids": token_ids, "logprobs": logprobs, "text": text, "finish_reason": finish_reason}
        _set(m, "__dict__", values)
        _set(m, "__pydantic_fields_set__", set(_COMPLETION_FIELDS))
        _set(m, "__pydantic_extra__", None)
        _set(m, "__pydantic_private__", None)
        return m

    def __len__(self) -> int:
        return int(self.token_ids.size)

    def __eq__(self, other: object) -> bool:
        # pydantic's field-by-field == would ask numpy arrays for a truth value.
        if not isinstance(other, Completion):
            return NotImplemented
        return (
            self.text == other.text
            and self.finish_reason == other.finish_reason
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.logprobs, other.logprobs)
        )

    __hash__ = None  # type: ignore[assignment]  # holds mutable arrays


class Group(BaseModel):
    """One prompt answered G times by ONE generator model; advantages are computed within it."""

    model_config = _MODEL_CONFIG

    task_id: Name  # enough for any peer to regenerate the prompt and its answer
    generator_model_id: Name
    sampling: SamplingParams
    completions: list[Completion] = Field(min_length=1)

    @model_validator(mode="after")
    def _within_max_tokens(self) -> Group:
        limit = self.sampling.max_tokens
        for i, c in enumerate(self.completions):
            if c.token_ids.size > limit:
                raise ValueError(f"completion {i} has {c.token_ids.size} tokens, more than max_tokens={limit}")
        return self

    @classmethod
    def of(
        cls, task_id: str, generator_model_id: str, sampling: SamplingParams, completions: list[Completion]
    ) -> Group:
        """Positional shorthand."""
        return cls(task_id=task_id, generator_model_id=generator_model_id, sampling=sampling, completions=completions)


class PacketHeader(BaseModel):
    """Who sent the packet, for which swarm and round, from which model and tokenizer."""

    model_config = _MODEL_CONFIG

    protocol_version: int = Field(PROTOCOL_VERSION, ge=1, le=255)
    swarm_id: str
    round: int = Field(ge=0, le=2**63 - 1)
    sender_peer_id: Name
    sender_name: DisplayName = ""  # the sender's --name, unverified: who it says it is, not who it is
    base_model_id: Name
    adapter_version: Name  # hash of the LoRA adapter that sampled; "base" before any update
    tokenizer_fingerprint: Name  # equal fingerprints => token ids are directly comparable
    vocab_size: int = Field(ge=1, le=2**32)  # every token id must be < vocab_size
    created_at: float = Field(ge=0, allow_inf_nan=False)  # DHT (unix) seconds

    @field_validator("swarm_id")
    @classmethod
    def _swarm_id(cls, v: str) -> str:
        return validate_swarm_id(v)

    @classmethod
    def create(
        cls,
        *,
        swarm_id: str,
        round: int,
        sender_peer_id: str,
        base_model_id: str,
        tokenizer_fingerprint: str,
        vocab_size: int,
        adapter_version: str = "base",
        sender_name: str = "",
        created_at: float | None = None,
    ) -> PacketHeader:
        """Header stamped with the current time unless `created_at` is given."""
        return cls(
            swarm_id=swarm_id,
            round=round,
            sender_peer_id=sender_peer_id,
            sender_name=sender_name,
            base_model_id=base_model_id,
            adapter_version=adapter_version,
            tokenizer_fingerprint=tokenizer_fingerprint,
            vocab_size=vocab_size,
            created_at=time.time() if created_at is None else created_at,
        )


class RolloutPacket(BaseModel):
    """One node's contribution to one round: a header and its groups."""

    model_config = _MODEL_CONFIG

    header: PacketHeader
    groups: list[Group] = Field(default_factory=list)

    @model_validator(mode="after")
    def _ids_in_vocab(self) -> RolloutPacket:
        vocab = self.header.vocab_size
        for gi, g in enumerate(self.groups):
            for ci, c in enumerate(g.completions):
                if c.token_ids.size and int(c.token_ids.max()) >= vocab:
                    raise ValueError(
                        f"group {gi} completion {ci}: token id {int(c.token_ids.max())} "
                        f"is outside the vocabulary (vocab_size={vocab})"
                    )
        return self

    def completions(self) -> Iterator[tuple[Group, Completion]]:
        """Every completion with its group, in wire order."""
        for g in self.groups:
            for c in g.completions:
                yield g, c

    @property
    def num_completions(self) -> int:
        return sum(len(g.completions) for g in self.groups)

    @property
    def num_tokens(self) -> int:
        return sum(c.token_ids.size for g in self.groups for c in g.completions)
