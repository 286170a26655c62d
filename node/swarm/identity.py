"""A node's identity: one RSA key, the libp2p identity that also signs its DHT records.

The key file is hivemind's format (a libp2p protobuf PrivateKey holding RSA DER), so
p2pd loads it as it is and the peer id is the libp2p hash of its public half. Signing
records with the same key makes a record's owner subkey prove its writer's peer id
(`record.peer_id_of_owner`). Without an identity path the node makes a fresh key in a
private temporary folder, removed at shutdown. An exclusive lock (`<identity>.lock`)
stops two nodes from running on one identity.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import threading
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from node.swarm.errors import SwarmStartError

__all__ = ["NodeIdentity"]


_LOCKED_IN_PROCESS: set[str] = set()
_LOCKED_GUARD = threading.Lock()


class NodeIdentity:
    """The node's key (libp2p identity and record signer) and the lock that makes it exclusive.

    The lock is a POSIX record lock, which a forked child (the DHT process) does not
    inherit, so it never outlives the node process; a set of paths locked by this
    process catches two nodes in one process, which POSIX locks allow.
    """

    def __init__(
        self, identity_path: Path, key: RSAPrivateKey, lock_fd: int | None, *, fresh: bool, temp_dir: str | None = None
    ) -> None:
        self.identity_path = identity_path  # what p2pd loads
        self.key = key
        self.fresh = fresh  # made just now: no other peer can be using it
        self._lock_fd = lock_fd
        self._temp_dir = temp_dir

    @property
    def peer_id(self) -> str:
        return str(PeerID.from_identity(_identity_bytes(self.key)))

    @classmethod
    def acquire(cls, identity_path: Path | None) -> NodeIdentity:
        if identity_path is None:  # a throw-away key, in a folder only we can read
            temp_dir = tempfile.mkdtemp(prefix="ftis-identity-")
            path = Path(temp_dir) / "identity.key"
            return cls(path, _create_identity(path), None, fresh=True, temp_dir=temp_dir)
        identity_path = Path(identity_path).expanduser().resolve()
        try:
            identity_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SwarmStartError(f"cannot create the identity folder {identity_path.parent}: {e.strerror}") from None
        lock_fd = _lock_identity(identity_path)
        try:
            fresh = not identity_path.exists()
            key = _create_identity(identity_path) if fresh else _load_identity(identity_path)
        except BaseException:
            _unlock_identity(identity_path, lock_fd)
            raise
        return cls(identity_path, key, lock_fd, fresh=fresh)

    def release(self) -> None:
        if self._lock_fd is not None:
            _unlock_identity(self.identity_path, self._lock_fd)
            self._lock_fd = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def _identity_bytes(key: RSAPrivateKey) -> bytes:
    """hivemind's identity file format: a libp2p protobuf PrivateKey holding the RSA key's DER."""
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()


def _load_identity(path: Path) -> RSAPrivateKey:
    advice = "delete it to make a new one (the node then gets a new peer id)"
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError(f"a {crypto_pb2.KeyType.Name(proto.key_type)} key; records are signed with RSA keys")
        loaded = serialization.load_der_private_key(proto.data, password=None)  # fail here, with the path
        if not isinstance(loaded, rsa.RSAPrivateKey):
            raise ValueError(f"not an RSA key but {type(loaded).__name__}")
    except (OSError, ValueError, TypeError, DecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise SwarmStartError(f"identity {path} is unreadable ({reason}); {advice}") from None
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": proto.data})  # hivemind's own (pickle) path from DER bytes
    return key


def _create_identity(path: Path) -> RSAPrivateKey:
    key = RSAPrivateKey()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise SwarmStartError(f"cannot write the identity {path}: {e.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(_identity_bytes(key))
    return key


def _lock_path(identity_path: Path) -> Path:
    return identity_path.with_name(identity_path.name + ".lock")


def _lock_identity(identity_path: Path) -> int:
    lock_path = _lock_path(identity_path)
    advice = "give each node its own identity (--data-dir)"
    with _LOCKED_GUARD:
        if str(identity_path) in _LOCKED_IN_PROCESS:
            raise SwarmStartError(f"identity {identity_path} is already used by another node in this process; {advice}")
        # Check the in-process set *before* opening: closing any fd of a POSIX-locked
        # file drops this process's lock on it.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise SwarmStartError(
                f"identity {identity_path} is already used by another running node (pid {holder}); {advice}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _LOCKED_IN_PROCESS.add(str(identity_path))
        return fd


def _unlock_identity(identity_path: Path, fd: int) -> None:
    with _LOCKED_GUARD:
        _LOCKED_IN_PROCESS.discard(str(identity_path))
        os.close(fd)  # releases the POSIX lock
