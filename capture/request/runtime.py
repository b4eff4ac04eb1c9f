"""What the sidecar knows about the serving side: artifact hashes and the runtime fingerprint.

Three sources, each optional, merged once and cached:

- the deployment manifest (``reprolane-manifest.json``, written by ``reprolane model fetch``; its format and
  its one decoder are `schemas.manifest`): its ``model_sha256``, ``tokenizer_sha256`` and
  ``chat_template_sha256`` become the envelope's `ArtifactHashes`;
- the runtime file: JSON of `RuntimeFingerprint` fields the sidecar cannot observe (dtype, device, parallel
  sizes, attention backend, ...), validated at startup (`schemas.manifest.decode_runtime_file`) so a typo is
  an error, not a silent ``None``;
- what upstream reports: ``GET /version`` (engine version) and each response's ``system_fingerprint``.

The LoRA adapters upstream serves (``lora_modules``, as vLLM's ``--lora-modules``) are hashed at start
(`load_adapters`: every file of each directory, `infra.clients.digest.directory_sha256`): a request whose
``model`` names one records the base model's hashes and the adapter's name and digest (`Artifacts.of`). A
directory that cannot be hashed stops the sidecar at start, never a request. A request naming a model the sidecar
was not told about records the base model's hashes as before; the replay side refuses an envelope whose model it
serves as an adapter when the envelope names none (`replayer.replay`).

The manifest also says which sampling defaults upstream applies to a request that leaves a field out
(`load_sampling_defaults`), so each envelope's contract records what upstream used, not what vLLM would use
for a model without a ``generation_config.json``.

Observed values win over the runtime file for ``engine_version`` and ``system_fingerprint``; the file's own
values stand for everything else. The manifest's ``dtype`` is the dtype the weights were *stored* in, not the
one they are served in, so it never fills the fingerprint's ``dtype``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from capture.errors import CaptureError, UpstreamError
from capture.protocol.sampling import SamplingDefaults
from capture.request.upstream import Upstream
from infra.clients.digest import directory_sha256
from schemas import ArtifactHashes, ContractError, RuntimeFingerprint
from schemas.manifest import ModelManifest, decode_manifest, decode_runtime_file
from schemas.sampling import GENERATION_CONFIG_FIELDS

log = logging.getLogger(__name__)

_VLLM_FP_RE = re.compile(r"^vllm-(?P<version>[^-]+)-")
_PROBE_RETRY_S = 30.0


def load_manifest(manifest_path: Path) -> ModelManifest:
    """The deployment manifest (`schemas.manifest.decode_manifest`); `CaptureError` naming the path and fields."""
    try:
        return decode_manifest(_read(manifest_path, "manifest"))
    except ContractError as exc:
        raise CaptureError(f"manifest {manifest_path}: {exc}") from exc


def load_artifacts(manifest_path: Path | None) -> ArtifactHashes:
    """Artifact hashes from a deployment manifest; all ``None`` when there is no manifest."""
    if manifest_path is None:
        return ArtifactHashes()
    manifest = load_manifest(manifest_path)
    return ArtifactHashes(
        model_sha256=manifest.model_sha256,
        tokenizer_sha256=manifest.tokenizer_sha256,
        chat_template_sha256=manifest.chat_template_sha256,
        manifest_source=str(manifest_path),
    )


@dataclass(frozen=True)
class Artifacts:
    """The artifact hashes an envelope records, by the model its request named: ``base`` (the manifest's), and
    for the name of an adapter upstream serves, ``base`` with that adapter's name and digest."""

    base: ArtifactHashes = field(default_factory=ArtifactHashes)
    adapters: Mapping[str, ArtifactHashes] = field(default_factory=dict)

    @classmethod
    def of_adapters(cls, base: ArtifactHashes, adapters: Mapping[str, str]) -> Artifacts:
        """``base`` and, per adapter name, its digest (`load_adapters`)."""
        return cls(
            base,
            {
                name: base.model_copy(update={"adapter_name": name, "adapter_sha256": sha})
                for name, sha in adapters.items()
            },
        )

    def of(self, model: str) -> ArtifactHashes:
        """The hashes of a request naming ``model`` (a dictionary lookup on the hot path)."""
        return self.adapters.get(model, self.base)


def load_adapters(lora_modules: Mapping[str, Path]) -> dict[str, str]:
    """Each adapter's digest (every file of its directory, as a lane hashes its own copy); `CaptureError` naming
    the adapter and the directory when it cannot be hashed (missing, not a directory, empty, unreadable)."""
    out: dict[str, str] = {}
    for name, path in lora_modules.items():
        if not name or name != name.strip():
            raise CaptureError(f"lora module {name!r}: an adapter name must be a non-empty name without spaces")
        if not (path / "adapter_config.json").is_file():
            raise CaptureError(f"lora module {name}: {path} has no adapter_config.json (not a LoRA adapter directory)")
        try:
            out[name] = directory_sha256(path)
        except OSError as exc:
            raise CaptureError(f"lora module {name}: cannot hash {path}: {exc}") from exc
        log.info("lora module %s: %s sha256 %s", name, path, out[name])
    return out


def load_sampling_defaults(
    manifest_path: Path | None, generation_config: str, overrides: dict[str, float]
) -> SamplingDefaults:
    """What upstream vLLM uses for a sampling field a request leaves out, as its ``get_diff_sampling_param``
    computes it: its own defaults, over them the model's (the manifest's ``generation_defaults``) unless it runs
    with ``--generation-config vllm``, over both ``--override-generation-config`` (``overrides``, Hugging Face
    names: ``max_new_tokens`` is ``max_tokens``)."""
    values: dict[str, float | int] = {}
    if manifest_path is not None and generation_config == "auto":
        manifest = load_manifest(manifest_path)
        if not manifest.knows_generation_defaults:
            log.warning(
                "manifest %s has no generation_defaults (written before manifest version 3): envelopes record "
                "vLLM's own sampling defaults; if the model's generation_config.json sets temperature, top_p, ... "
                "rebuild the manifest (reprolane model fetch --force)",
                manifest_path,
            )
        else:
            values.update(
                _sampling_fields(manifest.generation_defaults, f"manifest {manifest_path}: generation_defaults")
            )
    # As vLLM reads its flag: Hugging Face names (``max_tokens`` there is not one, so it is ignored, as by vLLM).
    renamed = {GENERATION_CONFIG_FIELDS[k]: v for k, v in overrides.items() if k in GENERATION_CONFIG_FIELDS}
    values.update(_sampling_fields(renamed, "upstream_override_generation_config"))
    return SamplingDefaults(values)


_DEFAULT_FIELDS: Final = frozenset(GENERATION_CONFIG_FIELDS.values())  # their names in the contract


def _sampling_fields(found: dict[str, Any], where: str) -> dict[str, float | int]:
    """The fields vLLM takes as sampling defaults (others, like ``do_sample``, it ignores; so do we)."""
    out: dict[str, float | int] = {}
    for name, value in found.items():
        if name not in _DEFAULT_FIELDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CaptureError(f"{where}: {name} is {value!r}, not a number")
        out[name] = int(value) if name in ("top_k", "max_tokens") else value
    return out


def load_runtime_file(runtime_path: Path | None) -> dict[str, Any]:
    """Fields of `RuntimeFingerprint` from a JSON file, validated (unknown or ill-typed fields are errors)."""
    if runtime_path is None:
        return {}
    try:
        return decode_runtime_file(_read(runtime_path, "runtime file"))
    except ContractError as exc:
        raise CaptureError(f"runtime file {runtime_path}: {exc}") from exc


def _read(path: Path, what: str) -> bytes:
    """The bytes of ``path``; `CaptureError` naming ``what`` and the path when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CaptureError(f"cannot read {what} {path}: {exc}") from exc


class RuntimeProbe:
    """The runtime fingerprint of the upstream server, built once per distinct ``system_fingerprint``.

    `probe` asks ``GET /version`` (at startup, and again at most every 30 s while it has not answered);
    `fingerprint` is then a dictionary lookup on the hot path.
    """

    def __init__(self, runtime_fields: dict[str, Any]) -> None:
        self._file = dict(runtime_fields)
        self._engine_version: str | None = None
        self._version_known = False
        self._last_probe = float("-inf")
        self._cache: dict[tuple[str | None, str | None], RuntimeFingerprint] = {}

    @property
    def needs_probe(self) -> bool:
        return not self._version_known and time.monotonic() - self._last_probe >= _PROBE_RETRY_S

    async def probe(self, upstream: Upstream) -> None:
        """Ask upstream ``/version``; failures are logged and retried later, never raised."""
        self._last_probe = time.monotonic()
        try:
            status, body = await upstream.get_json("/version")
        except UpstreamError as exc:
            log.warning("upstream /version not available (%s); engine_version unknown for now", exc)
            return
        if status != 200:
            body = None
        if isinstance(body, dict) and isinstance(body.get("version"), str):
            self._engine_version = body["version"]
            self._version_known = True
            self._cache.clear()
        else:
            log.warning("upstream /version answered %s without a version; engine_version unknown", status)

    def fingerprint(self, system_fingerprint: str | None, vendor_version: str | None = None) -> RuntimeFingerprint:
        """The fingerprint for what one response reported. `vendor_version` (model name + version headers)
        is kept only for upstreams that are not a known engine: for vLLM the engine version says more."""
        key = (system_fingerprint, vendor_version)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._build(system_fingerprint, vendor_version)
            if len(self._cache) > 64:  # a server that changes its fingerprint per request must not grow us
                self._cache.clear()
            self._cache[key] = cached
        return cached

    def _build(self, system_fingerprint: str | None, vendor_version: str | None) -> RuntimeFingerprint:
        fields: dict[str, Any] = dict(self._file)
        match = _VLLM_FP_RE.match(system_fingerprint or "")
        if match:
            fields["engine"] = "vllm"
        elif self._version_known and "engine" not in fields:
            fields["engine"] = "vllm"  # /version answering {"version": ...} is vLLM's shape
        fields.setdefault("engine", "unknown")
        version = self._engine_version or (match.group("version") if match else None)
        if version is not None:
            fields["engine_version"] = version
        if system_fingerprint is not None:
            fields["system_fingerprint"] = system_fingerprint
        if vendor_version is not None and fields["engine"] == "unknown":
            fields["vendor_version"] = vendor_version
        return RuntimeFingerprint.model_validate(fields)
