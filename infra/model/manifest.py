"""The model manifest: what a converted model directory must contain, byte for byte.

A replay is only as trustworthy as the weights it loads, so a model directory is never used on faith.
At build time :func:`write_manifest` hashes every file into ``reprolane-manifest.json``; before each use
:func:`verify_model` hashes them again and refuses the directory if anything is missing, extra, or
different. There is no "probably fine" state: a directory either verifies or raises
:class:`~infra.errors.ModelCacheError`.

Three digests summarise the directory, so records can name "which model" in one field each:

* ``model_sha256``: the weights plus ``config.json`` (and ``generation_config.json``, because vLLM
  takes default sampling settings from it, so it changes outputs like the weights do);
* ``tokenizer_sha256``: every other file (tokenizer JSON, special tokens, chat template file);
* ``chat_template_sha256``: the chat template string itself, UTF-8, as the tokenizer applies it.

The manifest also carries ``generation_defaults``: the sampling fields vLLM takes from ``generation_config.json``
for a request that leaves them out (its default ``--generation-config auto``), so a capture sidecar that only has
the manifest can record the contract upstream actually applied (`generation_defaults`).

The format itself, its typed model and its one decoder are `schemas.manifest` (the sidecar reads the same file);
this module writes it and verifies a directory against it.

A digest over a set of files is the sha256 of the lines ``"<name>\\t<sha256 of file>\\n"`` sorted by
name (see :func:`digest_files`): independent of file order and of the directory's location. The hashing itself is
`infra.clients.digest`, which the sidecar and the lanes use for LoRA adapters too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from infra.clients.digest import digest_files, sha256_file
from infra.clients.digest import hash_directory as _hash_directory
from infra.errors import ModelCacheError
from schemas.errors import ContractError
from schemas.manifest import (
    MANIFEST_NAME,
    MANIFEST_VERSION,
    ModelManifest,
    ModelSource,
    decode_manifest,
    is_model_file,
    is_weight_file,
)
from schemas.sampling import GENERATION_CONFIG_FIELDS


def hash_directory(path: Path) -> dict[str, str]:
    """sha256 of every regular file under ``path`` (relative POSIX names), the manifest excluded."""
    return _hash_directory(path, exclude=(MANIFEST_NAME,))


def split_digests(file_hashes: Mapping[str, str]) -> tuple[str, str]:
    """``(model_sha256, tokenizer_sha256)`` of a directory's file hashes."""
    model = {name: sha for name, sha in file_hashes.items() if is_model_file(name)}
    tokenizer = {name: sha for name, sha in file_hashes.items() if not is_model_file(name)}
    return digest_files(model), digest_files(tokenizer)


def tokenizer_sha256_of(path: Path) -> str:
    """The ``tokenizer_sha256`` of a model directory as it is now (its non-model files only, so the weights are
    not read): what a reader compares with an envelope's before decoding its token ids with this tokenizer."""
    hashes = {
        file.relative_to(path).as_posix(): sha256_file(file)
        for file in sorted(path.rglob("*"))
        if file.is_file() and file.name != MANIFEST_NAME and not is_model_file(file.relative_to(path).as_posix())
    }
    return digest_files(hashes)


def generation_defaults(path: Path) -> dict[str, float | int]:
    """The sampling defaults in ``path/generation_config.json`` as vLLM reads them: the fields it uses, those
    not null (with transformers 5 every value the file sets differs from `GenerationConfig`'s all-None
    defaults, so vLLM's "diff" is the file itself). No file: none."""
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelCacheError(f"{file}: not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelCacheError(f"{file}: not a JSON object")
    out: dict[str, float | int] = {}
    for hf_name, name in GENERATION_CONFIG_FIELDS.items():
        value = config.get(hf_name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelCacheError(f"{file}: {hf_name} is {value!r}, not a number")
        out[name] = value
    return out


def write_manifest(
    path: Path,
    *,
    model_name: str,
    source: ModelSource,
    dtype: str,
    chat_template: str,
    created_at: datetime,
) -> ModelManifest:
    """Hash the finished directory ``path`` and write its manifest (the last file written)."""
    files = hash_directory(path)
    if not any(is_weight_file(name) for name in files):
        raise ModelCacheError(f"{path}: no weight file to put in a manifest")
    model_sha, tokenizer_sha = split_digests(files)
    manifest = ModelManifest(
        model_name=model_name,
        source=source,
        dtype=dtype,
        files=files,
        model_sha256=model_sha,
        tokenizer_sha256=tokenizer_sha,
        chat_template_sha256=hashlib.sha256(chat_template.encode("utf-8")).hexdigest(),
        generation_defaults=generation_defaults(path),
        created_at=created_at,
        path=path,
    )
    (path / MANIFEST_NAME).write_text(manifest.encode(), encoding="utf-8")
    return manifest


def load_manifest(path: Path) -> ModelManifest:
    """Read ``path``'s manifest without checking the files (cheap; see :func:`verify_model`).

    Raises :class:`ModelCacheError` when the directory or manifest is missing or unparseable.
    """
    manifest_file = path / MANIFEST_NAME
    try:
        raw = manifest_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelCacheError(f"{path}: no {MANIFEST_NAME} (missing or partial model dir)") from None
    except OSError as exc:
        raise ModelCacheError(f"{manifest_file}: unreadable: {exc}") from exc
    try:
        manifest = decode_manifest(raw, path)
    except ContractError as exc:
        first_line = str(exc).splitlines()[0]
        raise ModelCacheError(f"{manifest_file}: unparseable manifest: {first_line}") from exc
    if manifest.manifest_version != MANIFEST_VERSION:
        raise ModelCacheError(
            f"{path}: manifest version {manifest.manifest_version}, expected {MANIFEST_VERSION} (older recipe)"
        )
    return manifest


def verify_model(path: Path) -> ModelManifest:
    """Re-hash every file of ``path`` against its manifest; return the manifest or raise.

    Detects: missing manifest, missing file, extra file, changed bytes, and a manifest whose
    summary digests do not match its own file list (hand-edited). The error message is one line that
    names the first problem found.
    """
    manifest = load_manifest(path)
    actual = hash_directory(path)
    missing = sorted(set(manifest.files) - set(actual))
    if missing:
        raise ModelCacheError(f"{path}: missing file {missing[0]} ({len(missing)} missing)")
    extra = sorted(set(actual) - set(manifest.files))
    if extra:
        raise ModelCacheError(f"{path}: unexpected file {extra[0]} ({len(extra)} not in manifest)")
    for name, expected in sorted(manifest.files.items()):
        if actual[name] != expected:
            raise ModelCacheError(f"{path}: sha256 mismatch in {name}: {actual[name][:12]} != {expected[:12]}")
    if split_digests(actual) != (manifest.model_sha256, manifest.tokenizer_sha256):
        raise ModelCacheError(f"{path}: manifest digests do not match its file list")
    return manifest
