"""Known-good environments: what a passing release gate records, so a failing one can name what to roll back to.

A gate that passes has shown that one environment (`schemas.environment.EnvironmentFingerprint`) serves the
golden set at its declared levels. That alone is not enough to roll back to it: an operator needs what to
*deploy* to get that environment again, which the fingerprint only hashes. So the record holds, beside the
fingerprint and its sha256:

- the image reference (`ImageRef`: repository, tag, and the digest where known: a tag can move, a digest cannot);
- the model manifest (`schemas.manifest.ModelManifest`: every file of the model folder with its sha256, and the
  conversion source), whose summary digests must equal the fingerprint's artifact hashes;
- the engine's arguments (argv after the program, as the server was started), since dtype, scheduling limits
  and eager mode are arguments;
- what the gate judged (`GateSummary`).

Records are grouped by *deployment* (a name: ``default``, ``prod-eu``, ...), because two deployments can pass
different environments and a rollback target is the last one *that deployment* passed. Each record is written
once under a key built from its passing time and its own sha256 (`schemas.layout.known_good_key`), so a listing
of a deployment's prefix is its history in order, and a reader checks a record against its key
(`check_known_good`): a record whose id, time or deployment does not match the key it was found under is not
trusted.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from pydantic import Field, model_validator

from schemas.base import Record, UtcDatetime, decode_record
from schemas.canonical import canonical_bytes, sha256_hex
from schemas.environment import EnvironmentFingerprint
from schemas.errors import ContractError
from schemas.layout import known_good_key
from schemas.manifest import ModelManifest

KNOWN_GOOD_SCHEMA_VERSION: Final = "reprolane.known-good/1"
#: A deployment name: what may stand in an object key without escaping.
DEPLOYMENT_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DEFAULT_DEPLOYMENT: Final = "default"

# repository[:tag][@sha256:<64 hex>]; the repository may hold a registry host with a port (``host:5000/repo``).
_IMAGE = re.compile(
    r"^(?P<repository>[a-z0-9][a-z0-9._\-/:]*?[a-z0-9])(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
_MAX_IMAGE_REF = 512


class ImageRef(Record):
    """An OCI image reference, split: a tag can be moved to another image, the digest names one image."""

    reference: str = Field(min_length=1, max_length=_MAX_IMAGE_REF, description="as given")
    repository: str
    tag: str | None = None
    digest: str | None = Field(default=None, pattern=r"^sha256:[0-9a-f]{64}$")

    @property
    def pinned(self) -> str:
        """What to deploy: ``repository@digest`` when the digest is known (a tag can move), else the reference."""
        return f"{self.repository}@{self.digest}" if self.digest else self.reference


def parse_image_ref(text: str) -> ImageRef:
    """`ImageRef` of ``repository[:tag][@sha256:HEX]``; `ContractError` naming the problem otherwise."""
    if not 0 < len(text) <= _MAX_IMAGE_REF:
        raise ContractError(f"image reference must be 1..{_MAX_IMAGE_REF} characters")
    match = _IMAGE.match(text)
    if match is None:
        raise ContractError(f"not an image reference (repository[:tag][@sha256:<64 hex>]): {text!r}")
    repository = match["repository"]
    if repository.endswith(":") or "//" in repository:
        raise ContractError(f"not an image reference: {text!r}")
    return ImageRef(reference=text, repository=repository, tag=match["tag"], digest=match["digest"])


class GateSummary(Record):
    """What the passing gate judged (the full report stays with the CI run that produced it)."""

    golden: str
    replayed: bool
    lane: str | None = None
    total: int = Field(ge=0)
    passed: int = Field(ge=0)
    pass_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    min_pass_rate: float = Field(ge=0.0, le=1.0)
    reason: str
    baseline_sha256: str


class KnownGoodEnvironment(Record):
    """One environment a gate passed, with what to deploy to get it back (see the module docstring)."""

    schema_version: Literal["reprolane.known-good/1"] = KNOWN_GOOD_SCHEMA_VERSION
    deployment: str = Field(pattern=DEPLOYMENT_PATTERN)
    environment_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    environment: EnvironmentFingerprint
    image: ImageRef | None = None
    manifest: ModelManifest | None = None
    engine_args: tuple[str, ...] = ()
    gate: GateSummary
    passed_at: UtcDatetime

    @model_validator(mode="after")
    def _consistent(self) -> KnownGoodEnvironment:
        if self.environment.sha256() != self.environment_sha256:
            raise ValueError("environment_sha256 is not the sha256 of environment")
        if self.manifest is not None:
            arts = self.environment.artifacts
            held = (self.manifest.model_sha256, self.manifest.tokenizer_sha256, self.manifest.chat_template_sha256)
            if held != (arts.model_sha256, arts.tokenizer_sha256, arts.chat_template_sha256):
                raise ValueError("manifest digests do not match the environment's artifact hashes")
        return self

    def canonical(self) -> bytes:
        """The bytes stored (`schemas.canonical`)."""
        return canonical_bytes(self)

    def record_id(self) -> str:
        """The record's identity: sha256 of its canonical bytes (part of its key)."""
        return sha256_hex(self.canonical())


def decode_known_good(data: bytes | str) -> KnownGoodEnvironment:
    return decode_record(KnownGoodEnvironment, "known-good environment", data)


def check_known_good(record: KnownGoodEnvironment, found_key: str) -> None:
    """`ContractError` unless `record` is the one the key it was read from names (deployment, time and id: the key
    `schemas.layout.known_good_key` builds from the record itself)."""
    if known_good_key(record.deployment, record.passed_at, record.record_id()) != found_key:
        raise ContractError(f"known-good record does not match its key {found_key!r}")
