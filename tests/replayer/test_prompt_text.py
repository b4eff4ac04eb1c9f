"""`replayer.prompt_text`: a prompt's text is decoded only with the tokenizer the envelope was recorded with.

A model directory with a manifest (`infra.model.manifest.write_manifest`) and a tiny word-level ``tokenizer.json``;
the envelope names that directory's ``tokenizer_sha256`` or another one.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from infra.model.manifest import write_manifest
from replayer.prompt_text import decode_prompts
from schemas import ArtifactHashes, Envelope, PromptRecord
from schemas.manifest import ModelSource
from tests.replayer.support import make_envelope

SOURCE = ModelSource(wheel="w", version="0", wheel_sha256="a" * 64, gguf_file="m.gguf", gguf_sha256="b" * 64)
VOCAB = {"[UNK]": 0, "audit": 1, "every": 2, "replay": 3}


def model_dir(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "model"
    path.mkdir()
    tokenizer = Tokenizer(WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    manifest = write_manifest(
        path, model_name="tiny", source=SOURCE, dtype="float32", chat_template="", created_at=datetime.now(UTC)
    )
    return path, manifest.tokenizer_sha256


def recorded(tokenizer_sha256: str | None) -> Envelope:
    return make_envelope(
        1,
        artifacts=ArtifactHashes(tokenizer_sha256=tokenizer_sha256),
        prompt=PromptRecord(token_ids=(2, 3, 1), source="upstream"),
        more_prompts=(PromptRecord(token_ids=(1,), source="upstream"),),
    )


def test_the_recorded_tokenizer_decodes_every_prompt(tmp_path: Path) -> None:
    path, sha = model_dir(tmp_path)
    decoded = decode_prompts(recorded(sha), path)
    assert decoded.reason is None
    assert decoded.texts == ("every replay audit", "audit")


def test_another_tokenizer_or_a_changed_file_is_never_used(tmp_path: Path) -> None:
    path, sha = model_dir(tmp_path)
    other = decode_prompts(recorded("c" * 64), path)
    assert other.texts == ()
    assert other.reason is not None
    assert "is not the recorded one" in other.reason
    assert decode_prompts(recorded(None), path).reason == "the envelope names no tokenizer"
    assert (
        decode_prompts(recorded(sha), None).reason == "no model directory is configured (REPROLANE_REPLAYER_MODEL_DIR)"
    )
    (path / "tokenizer.json").write_text((path / "tokenizer.json").read_text().replace('"audit"', '"audits"'))
    changed = decode_prompts(recorded(sha), path)
    assert changed.texts == ()
    assert changed.reason == f"{path / 'tokenizer.json'} differs from its manifest"
