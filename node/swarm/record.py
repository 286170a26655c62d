"""The swarm's DHT record: a small signed header per (peer, round), and who wrote it.

A node's header for round r lives at

    key    = shard_key(swarm_id, r, shard)                 "ftis/<swarm>/<r>/<shard>"
    subkey = b"[owner:<ssh-rsa public key>]"              the sender's libp2p identity key

Every node installs hivemind's `RSASignatureValidator` (signs our own stores, checks
everyone's), so only the holder of a key can write its slot, plus `HeaderRecordValidator`,
which bounds a record's size and schema and refuses unsigned slots.

Identity: the key that signs the slot IS the peer's libp2p identity key, so the peer id
is a function of the owner subkey (`peer_id_of_owner`: the libp2p rule, multihash of the
public key). A header that names any other peer id is rejected `impersonation` and
attributed to the signer's id, never to the id it claims. Bodies are fetched from that
same peer id over libp2p, whose connections are authenticated by the same key.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from functools import lru_cache
from typing import Any, Final, Literal

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPublicKey
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "MAX_RECORD_BYTES",
    "RECORD_OVERHEAD_BYTES",
    "SIGNATURE_MARK",
    "HeaderRecord",
    "HeaderRecordValidator",
    "RejectReason",
    "is_owner_subkey",
    "owner_label",
    "peer_id_of_owner",
]

RECORD_VERSION: Final = 2
# Hard cap on one DHT record's value, enforced by every node's validator. A protocol
# constant, not a setting: nodes that disagreed on it would store records their peers
# reject, and hivemind drops a key's whole answer if one entry is invalid. Headers are
# ~0.3 KiB; the cap leaves room for small inline bodies only (bodies travel P2P).
MAX_RECORD_BYTES = 64 << 10
# What a record needs besides its inline body (header fields, msgpack framing).
RECORD_OVERHEAD_BYTES = 1024
# RSASignatureValidator finds signatures by this marker anywhere in a value; a body
# that happens to contain it could not be stored inline, so it is sent as a reference.
SIGNATURE_MARK = b"[signature:"
_OWNER_PREFIX, _OWNER_SUFFIX = b"[owner:", b"]"
_TEXT = r"^[\x20-\x7e]*$"  # printable ASCII: shown on dashboards as it is


class RejectReason(StrEnum):
    """Why a peer's header (or the body it names) was not delivered."""

    BAD_RECORD = "bad_record"  # not a HeaderRecord
    IMPERSONATION = "impersonation"  # names a peer id other than the one its signing key proves
    ROUND_MISMATCH = "round_mismatch"  # stored under another round's key
    WRONG_SHARD = "wrong_shard"  # stored under a shard its peer id does not hash to
    OVER_PACKET_LIMIT = "over_packet_limit"  # declares more than max_packet_bytes (= protocol Limits.max_bytes)
    DUPLICATE = "duplicate"  # a second, different packet of one peer for one round
    DUPLICATE_CONTENT = "duplicate_content"  # bytes already delivered this round, under another peer
    RELAYED = "relayed"  # the body's own header names another sender than the record's signer
    OVER_BUDGET = "over_budget"  # max_total_bytes stayed used up until the gather ended
    HASH_MISMATCH = "hash_mismatch"  # body does not match the header's sha256
    SIZE_MISMATCH = "size_mismatch"  # fetched body has another length than the header says
    BODY_NOT_FOUND = "body_not_found"  # the sender no longer serves that body
    FETCH_TIMEOUT = "fetch_timeout"
    FETCH_FAILED = "fetch_failed"  # sender unreachable or the stream broke


class HeaderRecord(BaseModel):
    """The DHT value under (shard key, owner subkey). `body` is None unless the packet is tiny."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: Literal[2] = RECORD_VERSION
    round: int = Field(ge=0)
    peer: str = Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")  # base58 peer id
    shards: int = Field(1, ge=1, le=1 << 16)  # the shard count the writer used (a power of two)
    model: str = Field("", max_length=128, pattern=_TEXT)
    adapter: str = Field("", max_length=128, pattern=_TEXT)  # adapter version the packet was sampled with
    size: int = Field(ge=0)
    sha256: bytes = Field(min_length=32, max_length=32)
    body: bytes | None = None

    @model_validator(mode="after")
    def _consistent(self) -> HeaderRecord:
        if self.shards & (self.shards - 1):
            raise ValueError(f"shards must be a power of two, got {self.shards}")
        if self.body is not None and len(self.body) != self.size:
            raise ValueError(f"inline body has {len(self.body)} bytes, header says {self.size}")
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump()

    @classmethod
    def from_wire(cls, value: Any) -> HeaderRecord:
        if not isinstance(value, dict):
            raise ValueError(f"record must be a map, got {type(value).__name__}")
        return cls.model_validate(value)


def is_owner_subkey(subkey: Any) -> bool:
    return isinstance(subkey, bytes) and subkey.startswith(_OWNER_PREFIX) and subkey.endswith(_OWNER_SUFFIX)


@lru_cache(maxsize=8192)
def peer_id_of_owner(owner: bytes) -> str | None:
    """The libp2p peer id of the RSA key in an owner subkey (base58), or None if it holds no RSA key.

    libp2p: peer id = multihash(sha2-256, protobuf PublicKey{RSA, DER SubjectPublicKeyInfo}),
    the same computation as hivemind's `PeerID.from_identity` on the private half.
    """
    if not is_owner_subkey(owner):
        return None
    try:
        public = RSAPublicKey.from_bytes(owner[len(_OWNER_PREFIX) : -len(_OWNER_SUFFIX)])._public_key
        der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    except Exception:  # network bytes: anything unparsable is "no key"
        return None
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


def owner_label(owner: bytes) -> str:
    """The peer id an owner key proves; for a key that proves none, a label derived from its bytes."""
    return peer_id_of_owner(owner) or "owner:" + hashlib.sha256(owner).hexdigest()[:12]


class HeaderRecordValidator(RecordValidatorBase):
    """Every record in the swarm's DHT must be a signed-slot `HeaderRecord` of bounded size.

    Runs after RSASignatureValidator (lower priority), so it sees the value with the
    signature stripped. The bounds are protocol constants, the same on every node.
    """

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        try:
            if not is_owner_subkey(MSGPackSerializer.loads(record.subkey)):
                return False
            HeaderRecord.from_wire(MSGPackSerializer.loads(record.value))
        except Exception:  # network data: any failure to parse means "invalid"
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, HeaderRecordValidator)
