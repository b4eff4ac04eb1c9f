"""Sealing without the stack: KEK loading, and a sealer that seals only the configured tenants (the publisher that
cannot seal refuses to start: tests/capture/publishing/test_publisher.py)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from capture.ledger.errors import KeyringError
from capture.ledger.sealing import Sealer, load_kek
from capture.publishing.outgoing import Outgoing
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from schemas.sealed import decode_sealed, new_data_key, open_envelope
from tests.factories import envelope


def settings(tmp_path: Path, **overrides: Any) -> CaptureSettings:
    return CaptureSettings(upstream="http://127.0.0.1:9", spool_dir=tmp_path / "spool", **overrides)


def test_kek_from_setting_or_file(tmp_path: Path) -> None:
    kek = new_data_key()
    text = base64.b64encode(kek).decode()
    assert load_kek(settings(tmp_path, kek=text)) == kek
    (tmp_path / "kek").write_text(text + "\n")
    assert load_kek(settings(tmp_path, kek_file=tmp_path / "kek")) == kek
    with pytest.raises(KeyringError, match="no KEK is configured"):
        load_kek(settings(tmp_path))
    with pytest.raises(KeyringError, match="cannot read the KEK file"):
        load_kek(settings(tmp_path, kek_file=tmp_path / "missing"))
    with pytest.raises(KeyringError, match="32 bytes"):
        load_kek(settings(tmp_path, kek=base64.b64encode(b"short").decode()))


class FixedKeyring:
    def __init__(self) -> None:
        self.key = new_data_key()

    def current_key(self, tenant: str) -> tuple[str, bytes]:
        return f"k-{tenant}", self.key


def test_sealer_seals_only_the_configured_tenants() -> None:
    keyring = FixedKeyring()
    sealer = Sealer(keyring, ["acme-insurance"])  # type: ignore[arg-type]
    secret, plain = envelope(), envelope(tenant="globex")
    out = sealer.seal_batch(
        [Outgoing.from_entry(SpoolEntry(1, secret.canonical())), Outgoing.from_entry(SpoolEntry(2, plain.canonical()))]
    )
    assert out[1].payload == plain.canonical()
    assert out[0].schema_version == "reprolane.sealed/1"
    assert (out[0].envelope_id, out[0].object_key) == (secret.envelope_id(), out[0].object_key)
    assert out[0].index_keys() == Outgoing.from_entry(SpoolEntry(1, secret.canonical())).index_keys()
    sealed = decode_sealed(out[0].payload)
    assert sealed.key_id == "k-acme-insurance"
    assert open_envelope(sealed, keyring.key) == secret.canonical()
    assert sealer.seal(out[0]) is out[0]  # never sealed twice
