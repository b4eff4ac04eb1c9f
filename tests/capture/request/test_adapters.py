"""LoRA adapters at capture: a request naming an adapter upstream serves records the adapter's name and the digest
of every file of its directory beside the model's hashes; a base-model request records none; an adapter directory
that cannot be hashed stops the sidecar at start (issue 29)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from capture.cli import _lora_modules
from capture.errors import CaptureError
from capture.request import runtime
from capture.request.app import build_app
from capture.settings import CaptureSettings
from schemas import ArtifactHashes, Envelope
from schemas.canonical import canonical_bytes
from tests.capture.fake_spool import FakeSpool
from tests.capture.support import CHAT, MODEL, sidecar
from tests.factories import lora_adapter_dir as make_adapter
from tests.factories import manifest_doc


def expected_sha256(path: Path) -> str:
    """The recorded digest, computed here from its definition: sha256 of sorted ``name<TAB>sha256<LF>`` lines."""
    lines = "".join(
        f"{f.relative_to(path).as_posix()}\t{hashlib.sha256(f.read_bytes()).hexdigest()}\n"
        for f in sorted(path.rglob("*"))
        if f.is_file()
    )
    return hashlib.sha256(lines.encode()).hexdigest()


async def _envelopes(tmp_path: Path, adapter: Path) -> dict[str, Envelope]:
    manifest = tmp_path / "reprolane-manifest.json"
    manifest.write_text(json.dumps(manifest_doc(model_sha256="a" * 64)))
    async with sidecar(manifest_path=manifest, lora_modules={"tone": adapter}) as (client, _up, spool, _):
        for model in (MODEL, "tone"):
            reply = await client.post("/v1/chat/completions", json={**CHAT, "model": model})
            assert reply.status_code == 200, reply.text
    return {e.model: e for e in spool.envelopes}


async def test_a_request_naming_an_adapter_records_its_digest(tmp_path: Path) -> None:
    adapter = make_adapter(tmp_path / "tone")
    envelopes = await _envelopes(tmp_path, adapter)
    base, tuned = envelopes[MODEL].artifacts, envelopes["tone"].artifacts
    assert (base.model_sha256, base.adapter_name, base.adapter_sha256) == ("a" * 64, None, None)
    assert tuned.model_sha256 == "a" * 64  # the base model's hashes stay: the adapter runs on top of them
    assert (tuned.adapter_name, tuned.adapter_sha256) == ("tone", expected_sha256(adapter))


async def test_the_digest_covers_every_file_of_the_adapter(tmp_path: Path) -> None:
    first = await _envelopes(tmp_path / "a", make_adapter(tmp_path / "a" / "tone"))
    other = await _envelopes(tmp_path / "b", make_adapter(tmp_path / "b" / "tone", b"other lora weights"))
    with_card = make_adapter(tmp_path / "c" / "tone")
    (with_card / "README.md").write_text("a card")
    extra = await _envelopes(tmp_path / "c", with_card)
    digests = {e["tone"].artifacts.adapter_sha256 for e in (first, other, extra)}
    assert len(digests) == 3
    assert len({e[MODEL].envelope_id() for e in (first, other, extra)}) == 3  # request ids differ; ids are fine
    assert all(e[MODEL].artifacts.adapter_sha256 is None for e in (first, other, extra))


def test_an_envelope_without_adapter_keeps_its_bytes() -> None:
    """Envelopes written before adapters keep their ids: absent adapter fields are not in the canonical bytes."""
    arts = ArtifactHashes(model_sha256="a" * 64)
    assert b"adapter" not in canonical_bytes(arts)


def test_an_adapter_is_recorded_whole() -> None:
    with pytest.raises(ValueError, match="together"):
        ArtifactHashes(adapter_name="tone")
    with pytest.raises(ValueError, match="together"):
        ArtifactHashes(adapter_sha256="b" * 64)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("missing", "has no adapter_config.json"),
        ("no_config", "has no adapter_config.json"),
        ("a_file", "has no adapter_config.json"),
    ],
)
def test_an_adapter_that_cannot_be_hashed_stops_the_sidecar_at_start(tmp_path: Path, layout: str, message: str) -> None:
    path = tmp_path / "tone"
    if layout == "no_config":
        path.mkdir()
        (path / "adapter_model.safetensors").write_bytes(b"w")
    elif layout == "a_file":
        path.write_bytes(b"not a directory")
    settings = CaptureSettings(upstream="http://127.0.0.1:9", lora_modules={"tone": path})
    with pytest.raises(CaptureError, match=rf"lora module tone: .*{message}"):
        build_app(settings, spool=FakeSpool())


def test_an_unreadable_adapter_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An `OSError` while hashing (a file root may read but this deployment's user may not) names the adapter."""
    path = make_adapter(tmp_path / "tone")

    def unreadable(_: Path) -> str:
        raise PermissionError(13, "Permission denied", str(path / "adapter_model.safetensors"))

    monkeypatch.setattr(runtime, "directory_sha256", unreadable)
    settings = CaptureSettings(upstream="http://127.0.0.1:9", lora_modules={"tone": path})
    with pytest.raises(CaptureError, match=r"lora module tone: cannot hash .*Permission denied"):
        build_app(settings, spool=FakeSpool())


def test_the_lora_module_flag_is_vllms_syntax(tmp_path: Path) -> None:
    assert _lora_modules(["tone=/a/b", "other=rel"]) == {"tone": Path("/a/b"), "other": Path("rel")}
    assert _lora_modules(None) is None
    for bad in ("tone", "=path", "tone="):
        with pytest.raises(CaptureError, match="NAME=PATH"):
            _lora_modules([bad])
    with pytest.raises(CaptureError, match="given twice"):
        _lora_modules(["tone=a", "tone=b"])
    with pytest.raises(ValueError, match="pattern"):
        ArtifactHashes.model_validate({"adapter_name": "tone", "adapter_sha256": "xyz"})
