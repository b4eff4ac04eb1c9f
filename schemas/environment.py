"""The environment fingerprint: artifacts plus runtime, the unit a release gate compares.

`RuntimeFingerprint` describes *how* a computation runs; `ArtifactHashes` describe *what* runs. Together they
are the list a release engineer must freeze (model, tokenizer and chat-template sha256; engine, torch, CUDA
and cuBLAS versions; device and compute capability; attention backend; quantization; parallel sizes;
batch invariance; sampling-contract version). Any change in it should trigger a replay of the golden set
before the change ships, rather than waiting for "an occasional different answer" in production.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

from pydantic import Field

from schemas.base import Record, decode_record
from schemas.canonical import canonical_json, sha256_hex
from schemas.envelope import ArtifactHashes
from schemas.fingerprint import FieldDiff, RuntimeFingerprint, diff_fingerprints

FINGERPRINT_SCHEMA_VERSION: Final = "reprolane.fingerprint/1"


class EnvironmentFingerprint(Record):
    schema_version: Literal["reprolane.fingerprint/1"] = FINGERPRINT_SCHEMA_VERSION
    model_name: str | None = None
    artifacts: ArtifactHashes
    runtime: RuntimeFingerprint
    taken_at: datetime
    source: str = Field(description='what was fingerprinted: "local", a model dir, or an upstream URL')

    def sha256(self) -> str:
        """Identity of the environment: artifacts and runtime only (not when or where it was taken)."""
        data = {
            "artifacts": self.artifacts.model_dump(mode="json", exclude={"manifest_source"}, exclude_none=True),
            "runtime": self.runtime.model_dump(mode="json", exclude={"system_fingerprint"}, exclude_none=True),
        }
        return sha256_hex(canonical_json(data))


def diff_environments(
    a: EnvironmentFingerprint, b: EnvironmentFingerprint, *, include_unknown: bool = True
) -> tuple[FieldDiff, ...]:
    """Every artifact and runtime field that differs, named ``artifacts.x`` / ``runtime.y``.

    Unknown values count as differences by default here (unlike a replay's diff): a gate must not pass a
    candidate because it failed to report its CUDA version.
    """
    diffs = [
        FieldDiff(field=f"artifacts.{name}", recorded=getattr(a.artifacts, name), replayed=getattr(b.artifacts, name))
        for name in ArtifactHashes.model_fields
        if name != "manifest_source" and getattr(a.artifacts, name) != getattr(b.artifacts, name)
    ]
    diffs.extend(
        FieldDiff(field=f"runtime.{d.field}", recorded=d.recorded, replayed=d.replayed)
        for d in diff_fingerprints(a.runtime, b.runtime, include_unknown=include_unknown)
    )
    return tuple(diffs)


def decode_environment(data: bytes | str) -> EnvironmentFingerprint:
    return decode_record(EnvironmentFingerprint, "environment fingerprint", data)
