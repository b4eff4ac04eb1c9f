"""The runtime fingerprint: the settings of the execution environment that can change logits.

Seed, weights and prompt are not enough: engine and kernel versions, device, dtype, parallel topology,
attention backend, CUDA graphs, batch invariance and scheduling limits all change reduction order. The
fingerprint names them explicitly (as vLLM's config hash does for compilation) so that a replay can say
*which* of them differ between capture and replay, and so a release gate can trigger on any change.
``None`` means "not known by whoever recorded it", which is different from a known value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final

from pydantic import Field

from schemas.base import Record
from schemas.canonical import canonical_bytes, sha256_hex
from schemas.sampling import SAMPLING_CONTRACT_VERSION


class RuntimeFingerprint(Record):
    engine: str = Field(min_length=1, description='"vllm", "transformers", or "unknown" for foreign upstreams')
    engine_version: str | None = None
    system_fingerprint: str | None = Field(default=None, description="as reported by an OpenAI-style server")
    vendor_version: str | None = Field(
        default=None,
        description="for hosted APIs without an engine version: the resolved model name and version headers, "
        'canonical "key=value;..." sorted by key (e.g. "model=gpt-x-2026-01-01;openai-version=2020-10-01")',
    )
    torch_version: str | None = None
    cuda_version: str | None = None
    cublas_version: str | None = None
    device: str | None = Field(default=None, description='"cpu", "cuda", ...')
    device_name: str | None = Field(default=None, description="GPU name, or CPU model name")
    compute_capability: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    tensor_parallel_size: int | None = Field(default=None, ge=1)
    pipeline_parallel_size: int | None = Field(default=None, ge=1)
    data_parallel_size: int | None = Field(default=None, ge=1)
    attention_backend: str | None = None
    cuda_graphs: bool | None = Field(default=None, description="False when eager mode is enforced")
    batch_invariant: bool | None = None
    max_num_seqs: int | None = Field(default=None, ge=1)
    prefix_caching: bool | None = None
    num_threads: int | None = Field(default=None, ge=1)
    structured_outputs: str | None = Field(
        default=None,
        max_length=512,
        description="the structured-output backend setting and the versions of the grammar libraries that build its "
        'token masks, canonical "key=value;..." sorted by key (e.g. "backend=auto;llguidance=1.7.6;xgrammar=0.2.8"): a '
        "different backend or version can allow different tokens to a constrained request",
    )
    tool_call_parser: str | None = Field(
        default=None, max_length=128, description="the server's --tool-call-parser (None: no tool calls parsed)"
    )
    sampling_contract_version: str = SAMPLING_CONTRACT_VERSION

    def sha256(self) -> str:
        """Identity of this environment: any field change changes it."""
        return sha256_hex(canonical_bytes(self))


def cpu_model_name_of(cpuinfo: Iterable[str]) -> str | None:
    """A CPU's ``device_name``: the first "model name" of ``/proc/cpuinfo`` (its lines; the caller reads the file),
    "" when that line is empty, None when there is none (a caller may then ask the platform).

    The capture side's schedule recorder and the replayer's lanes both record it, and a diff between them is a
    changed environment: they must spell it alike, so the spelling lives with the field, not in either of them.
    """
    for line in cpuinfo:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


#: The grammar libraries vLLM 0.32's structured-output backends build their token masks with (xgrammar, guidance,
#: outlines), by distribution name: their versions are part of `RuntimeFingerprint.structured_outputs`.
STRUCTURED_OUTPUT_LIBRARIES: Final = ("xgrammar", "llguidance", "outlines_core")


def structured_outputs_of(backend: str, versions: Mapping[str, str | None]) -> str:
    """A `RuntimeFingerprint.structured_outputs` value: the backend setting (``auto``, ``xgrammar``, ...) and each
    installed library's version (`versions`: distribution name -> version, None when not installed; the caller
    reads them), ``key=value;...`` sorted by key. The capture side's stack and the replayer's lanes both write it,
    and a difference between them is a changed environment, so the spelling lives with the field."""
    pairs = {"backend": backend, **{name: v for name, v in versions.items() if v is not None}}
    return ";".join(f"{k}={pairs[k]}" for k in sorted(pairs))


class FieldDiff(Record):
    field: str
    recorded: Any = None
    replayed: Any = None


# Fields that describe *how the value was reported* rather than the computation: a differing
# system_fingerprint string is reported but alone does not mean the computation changed.
_INFORMATIONAL = frozenset({"system_fingerprint"})


def diff_fingerprints(
    recorded: RuntimeFingerprint, replayed: RuntimeFingerprint, *, include_unknown: bool = False
) -> tuple[FieldDiff, ...]:
    """Fields whose values differ, in declaration order.

    A field that one side does not know (``None``) is skipped unless `include_unknown`: "unknown" is not
    evidence of a change, and listing it would bury the fields that did change.
    """
    diffs: list[FieldDiff] = []
    for name in RuntimeFingerprint.model_fields:
        if name in _INFORMATIONAL:
            continue
        a, b = getattr(recorded, name), getattr(replayed, name)
        if a == b:
            continue
        if (a is None or b is None) and not include_unknown:
            continue
        diffs.append(FieldDiff(field=name, recorded=a, replayed=b))
    return tuple(diffs)
