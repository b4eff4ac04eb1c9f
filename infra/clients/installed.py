"""What this environment has installed, spelled as the runtime fingerprint spells it.

The stack's launcher writes it into the runtime file the sidecar stamps on every envelope, and each replay lane
into its own fingerprint; one function for both keeps the two comparable.
"""

from __future__ import annotations

from importlib import metadata

from schemas.fingerprint import STRUCTURED_OUTPUT_LIBRARIES, structured_outputs_of


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, None when it is not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_structured_outputs(backend: str) -> str:
    """`schemas.RuntimeFingerprint.structured_outputs` for an engine of this environment: its backend setting
    (vLLM's default, ``auto``, picks xgrammar or guidance per request) and the installed grammar libraries."""
    return structured_outputs_of(backend, {dist: installed_version(dist) for dist in STRUCTURED_OUTPUT_LIBRARIES})
