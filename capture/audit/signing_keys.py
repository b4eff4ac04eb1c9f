"""Ed25519 keys for checkpoints: load them from a PEM file or base64 of the raw 32 bytes, and make new ones.

A key setting is either a path to a file (PEM, or a file holding the base64 of the raw key) or the base64
itself. Only the 32 raw bytes leave this module; `schemas.merkle` signs and verifies with them.

A private key file that its group or others may read is refused (`SigningKeyError` naming the path and its
mode): whoever reads the checkpoint key can sign a forged log root, so it must be the owner's alone, as
`keygen` writes it (0600). Public key files may be readable by anyone.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path

from capture.audit.errors import SigningKeyError
from capture.audit.settings import AuditSettings


def _check_private_mode(path: Path) -> None:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise SigningKeyError(
            f"signing key {path}: mode {mode:04o} lets its group or others read it; "
            f"make it the owner's alone: chmod 600 {path}"
        )


def _material(spec: str, what: str, *, private: bool = False) -> bytes:
    path = Path(spec)
    try:
        if path.is_file():
            if private:
                _check_private_mode(path)
            return path.read_bytes().strip()
    except OSError as exc:
        raise SigningKeyError(f"{what} {spec}: cannot read: {exc}") from exc
    return spec.strip().encode()


def _raw(data: bytes, what: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SigningKeyError(f"{what}: neither a PEM file nor base64 of 32 raw bytes") from exc
    if len(raw) != 32:
        raise SigningKeyError(f"{what}: base64 decodes to {len(raw)} bytes, an Ed25519 key has 32")
    return raw


def load_private(spec: str) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        NoEncryption,
        PrivateFormat,
        load_pem_private_key,
    )

    data = _material(spec, "signing key", private=True)
    if not data.startswith(b"-----BEGIN"):
        return _raw(data, "signing key")
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"signing key {spec}: unreadable PEM: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"signing key {spec}: not an Ed25519 key")
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def public_of(private_raw: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return Ed25519PrivateKey.from_private_bytes(private_raw).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def load_public(spec: str) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat, load_pem_public_key

    data = _material(spec, "public key")
    if not data.startswith(b"-----BEGIN"):
        return _raw(data, "public key")
    try:
        key = load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"public key {spec}: unreadable PEM: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError(f"public key {spec}: not an Ed25519 key")
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def signing_key(settings: AuditSettings) -> bytes:
    if not settings.signing_key:
        raise SigningKeyError("no signing key: set REPROLANE_AUDIT_SIGNING_KEY (make one: reprolane keys signing)")
    return load_private(settings.signing_key)


def verifying_key(settings: AuditSettings) -> bytes:
    if settings.public_key:
        return load_public(settings.public_key)
    if settings.signing_key:
        return public_of(load_private(settings.signing_key))
    raise SigningKeyError("no public key: set REPROLANE_AUDIT_PUBLIC_KEY (or REPROLANE_AUDIT_SIGNING_KEY)")


def keygen(private_path: Path) -> tuple[Path, str]:
    """Write a new private key (PEM, mode 0600) and ``<path>.pub`` (PEM); return the .pub path and the
    base64 raw public key. Refuses to overwrite an existing key."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    public_path = private_path.with_name(private_path.name + ".pub")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise SigningKeyError(f"{private_path}: cannot create: {exc.strerror}") from exc
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public_path.write_bytes(key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return public_path, base64.b64encode(raw).decode()
