"""The statistical gate: for upstreams that offer no seed or version, regress on samples, not on tokens.

    reprolane release gate --statistical --golden CASES.jsonl --upstream URL [--samples N] [--assertions FILE.json]
                   [--min-similarity S] [--min-assertion-rate R] [--min-pass-rate P] [--report FILE.json]

A vendor API that takes no seed (or ignores it) and reports no engine version cannot promise token-level or
bitwise reproduction: the same request can legitimately come back different. What it can promise, and what this
gate checks, is *statistical* stability of each golden request:

- each golden case is sent ``samples`` times to the candidate with its recorded sampling (and no seed);
- every sample's text is compared with the recorded text by sentence-embedding cosine similarity
  (`replayer.semantic`, all-MiniLM-L6-v2, offline) and the per-case **mean** must reach ``min_similarity``;
- every sample is checked against the case's **assertions** (`Assertion`: ``contains``, ``not_contains``,
  ``regex``, ``max_length``, ``json_valid``) and the fraction of (sample, assertion) checks that hold must reach
  ``min_assertion_rate``;
- a case passes when both hold; the gate passes when ``passed cases / cases >= min_pass_rate``.

The recorded and observed **version identifiers** (the resolved ``model`` field, ``system_fingerprint``, and
version-like response headers: `VERSION_HEADERS`) are reported side by side, so a silent vendor model update
is visible even when the gate passes. Nothing is promised about token ids or logprobs.

A golden case (`VendorCase`) is the request body itself (messages or prompt, sampling), because a vendor
envelope usually has no prompt token ids. A golden JSONL line may also be an envelope with prompt token ids (a
vLLM capture); it becomes a ``/v1/completions`` case whose prompt is the token id list (`case_from_envelope`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal, Protocol

from pydantic import Field, ValidationError, model_validator

from replayer.errors import GateInputError
from replayer.report import ReportModel
from schemas import ContractError, Envelope, decode_envelope

__all__ = [
    "VENDOR_REPORT_VERSION",
    "VERSION_HEADERS",
    "Assertion",
    "CaseResult",
    "Sample",
    "Sampler",
    "StatisticalReport",
    "VendorCase",
    "case_from_envelope",
    "load_assertions",
    "load_cases",
    "render_statistical",
    "run_statistical_gate",
]

VENDOR_REPORT_VERSION: Final = "reprolane.vendor-gate/1"
#: Response headers recorded as version identifiers (lower case); extend with ``--version-header``.
VERSION_HEADERS: Final = ("openai-version", "anthropic-version", "x-model-version", "x-api-version", "openai-model")
_SEED_FIELDS: Final = ("seed",)

SimilarityFn = Callable[[str, str], float]


class Assertion(ReportModel):
    """One per-request check on a sample's text. Exactly one field is set."""

    contains: str | None = None
    not_contains: str | None = None
    regex: str | None = None
    max_length: int | None = Field(default=None, ge=0, description="characters")
    json_valid: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> Assertion:
        set_fields = [k for k, v in self.model_dump().items() if v is not None]
        if len(set_fields) != 1:
            raise ValueError(f"an assertion sets exactly one of {list(type(self).model_fields)}, not {set_fields}")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"regex {self.regex!r}: {exc}") from exc
        return self

    def describe(self) -> str:
        ((name, value),) = ((k, v) for k, v in self.model_dump().items() if v is not None)
        return f"{name}={value!r}"

    def check(self, text: str) -> bool:
        if self.contains is not None:
            return self.contains in text
        if self.not_contains is not None:
            return self.not_contains not in text
        if self.regex is not None:
            return re.search(self.regex, text) is not None
        if self.max_length is not None:
            return len(text) <= self.max_length
        try:
            json.loads(text)
        except ValueError:
            return not self.json_valid
        return bool(self.json_valid)


class VendorCase(ReportModel):
    """One golden request for the statistical gate (see module docstring)."""

    request_id: str
    endpoint: Literal["chat.completions", "completions"]
    body: dict[str, Any] = Field(description="the OpenAI request body as sent (model, messages|prompt, sampling)")
    recorded_text: str
    model_alias: str
    recorded_at: datetime | None = None
    versions: dict[str, str] = Field(default_factory=dict, description="version identifiers seen when recorded")


class Sample(ReportModel):
    text: str
    versions: dict[str, str] = Field(default_factory=dict)


class Sampler(Protocol):
    """Sends one case to the candidate and returns what came back (blocking). `HttpSampler` is the real one."""

    def sample(self, case: VendorCase) -> Sample: ...


def case_from_envelope(env: Envelope) -> VendorCase:
    """A completions case replaying the envelope's prompt token ids with its sampling, seed removed."""
    if not env.replayable or env.prompt is None or env.sampling is None or env.outcome.kind != "output":
        raise GateInputError(f"{env.request_id}: the envelope has no prompt token ids or no complete output")
    s = env.sampling
    recorded = env.outcome.choices[0]
    body: dict[str, Any] = {
        "model": env.model,
        "prompt": list(env.prompt.token_ids),
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_tokens": s.max_tokens or max(1, len(recorded.token_ids)),
    }
    if s.stop:
        body["stop"] = list(s.stop)
    versions = {k: v for k, v in (("system_fingerprint", env.runtime.system_fingerprint),) if v}
    if env.runtime.engine_version:
        versions["engine_version"] = env.runtime.engine_version
    return VendorCase(
        request_id=env.request_id,
        endpoint="completions",
        body=body,
        recorded_text=recorded.text,
        model_alias=env.model,
        recorded_at=env.captured_at,
        versions=versions,
    )


def load_cases(path: Path) -> tuple[VendorCase, ...]:
    """JSONL of `VendorCase` or envelope lines (``schema_version`` ``reprolane.envelope/1``)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise GateInputError(f"cannot read golden cases {path}: {exc}") from exc
    cases: list[VendorCase] = []
    for no, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            if '"reprolane.envelope/' in line:
                cases.append(case_from_envelope(decode_envelope(line)))
            else:
                cases.append(VendorCase.model_validate_json(line))
        except (ContractError, ValidationError) as exc:
            raise GateInputError(f"golden cases {path} line {no}: {exc}".splitlines()[0]) from exc
    if not cases:
        raise GateInputError(f"golden cases {path}: no case")
    return tuple(cases)


def load_assertions(path: Path) -> dict[str, tuple[Assertion, ...]]:
    """``{"request_id": [{"contains": "Paris"}, {"max_length": 200}, {"json_valid": true}], ...}`` (JSON)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GateInputError(f"cannot read assertions {path}: {exc}") from exc
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise GateInputError(f"assertions {path}: expected an object of request_id -> list of assertions")
    out: dict[str, tuple[Assertion, ...]] = {}
    for rid, items in data.items():
        try:
            out[rid] = tuple(Assertion.model_validate(item) for item in items)
        except ValidationError as exc:
            raise GateInputError(f"assertions {path} [{rid}]: {exc.errors()[0]['msg']}") from exc
    return out


class CaseResult(ReportModel):
    request_id: str
    passed: bool
    samples: int
    errors: tuple[str, ...] = Field(default=(), description="samples that failed to come back")
    similarities: tuple[float, ...]
    mean_similarity: float | None
    min_similarity: float | None
    assertion_checks: int
    assertion_passes: int
    assertion_pass_rate: float | None
    failed_assertions: dict[str, int] = Field(default_factory=dict, description="assertion -> samples failing it")
    recorded_versions: dict[str, str]
    observed_versions: dict[str, tuple[str, ...]]
    version_changed: bool
    recorded_text: str
    sample_texts: tuple[str, ...]


class StatisticalReport(ReportModel):
    """The statistical gate's verdict, as ``--report`` writes it: one `CaseResult` per golden case (its samples'
    similarities, assertion checks and version identifiers) and the totals."""

    schema_version: Literal["reprolane.vendor-gate/1"] = VENDOR_REPORT_VERSION
    mode: Literal["statistical"] = "statistical"
    golden: str
    candidate: str = Field(description="the endpoint sampled (--upstream)")
    samples_per_case: int
    min_similarity: float
    min_assertion_rate: float
    min_pass_rate: float
    total: int
    passed: int
    failed: int
    pass_rate: float
    versions_changed: int
    gate_passed: bool
    promise: str = "statistical: mean semantic similarity and per-request assertions; no token-level promise"
    cases: tuple[CaseResult, ...]


def _case(
    case: VendorCase,
    sampler: Sampler,
    similarity: SimilarityFn,
    assertions: Sequence[Assertion],
    samples: int,
    min_similarity: float,
    min_assertion_rate: float,
) -> CaseResult:
    got: list[Sample] = []
    errors: list[str] = []
    for _ in range(samples):
        try:
            got.append(sampler.sample(case))
        except GateInputError as exc:  # a sample that did not come back counts against the case
            errors.append(str(exc))
    sims = tuple(similarity(case.recorded_text, s.text) for s in got)
    failed: dict[str, int] = {}
    passes = 0
    for s in got:
        for a in assertions:
            if a.check(s.text):
                passes += 1
            else:
                failed[a.describe()] = failed.get(a.describe(), 0) + 1
    checks = len(assertions) * samples  # a missing sample fails every assertion
    mean = sum(sims) / samples if got else None  # a missing sample counts as similarity 0
    rate = passes / checks if checks else None
    observed: dict[str, set[str]] = {}
    for s in got:
        for k, v in s.versions.items():
            observed.setdefault(k, set()).add(v)
    changed = any(k in observed and observed[k] != {v} for k, v in case.versions.items())
    ok = mean is not None and mean >= min_similarity and (rate is None or rate >= min_assertion_rate)
    return CaseResult(
        request_id=case.request_id,
        passed=ok,
        samples=samples,
        errors=tuple(errors),
        similarities=sims,
        mean_similarity=mean,
        min_similarity=min(sims) if sims else None,
        assertion_checks=checks,
        assertion_passes=passes,
        assertion_pass_rate=rate,
        failed_assertions=failed,
        recorded_versions=dict(case.versions),
        observed_versions={k: tuple(sorted(v)) for k, v in observed.items()},
        version_changed=changed,
        recorded_text=case.recorded_text,
        sample_texts=tuple(s.text for s in got),
    )


def run_statistical_gate(
    cases: Sequence[VendorCase],
    sampler: Sampler,
    similarity: SimilarityFn,
    *,
    golden: str,
    candidate: str,
    assertions: Mapping[str, Sequence[Assertion]] | None = None,
    samples: int = 5,
    min_similarity: float = 0.8,
    min_assertion_rate: float = 1.0,
    min_pass_rate: float = 1.0,
) -> StatisticalReport:
    """Sample every case and decide (see module docstring). Assertions for unknown request ids are bad input."""
    if samples < 1 or not cases:
        raise GateInputError("the statistical gate needs at least one case and one sample")
    assertions = assertions or {}
    unknown = sorted(set(assertions) - {c.request_id for c in cases})
    if unknown:
        raise GateInputError(f"assertions name request ids that are not in the golden set: {', '.join(unknown)}")
    results = tuple(
        _case(c, sampler, similarity, assertions.get(c.request_id, ()), samples, min_similarity, min_assertion_rate)
        for c in cases
    )
    passed = sum(r.passed for r in results)
    rate = passed / len(results)
    return StatisticalReport(
        golden=golden,
        candidate=candidate,
        samples_per_case=samples,
        min_similarity=min_similarity,
        min_assertion_rate=min_assertion_rate,
        min_pass_rate=min_pass_rate,
        total=len(results),
        passed=passed,
        failed=len(results) - passed,
        pass_rate=rate,
        versions_changed=sum(r.version_changed for r in results),
        gate_passed=rate >= min_pass_rate,
        cases=results,
    )


def render_statistical(report: StatisticalReport) -> str:
    status = "PASS" if report.gate_passed else "FAIL"
    lines = [
        f"Statistical gate: {status} — {report.passed}/{report.total} case(s) passed"
        f" (pass rate {report.pass_rate:.3f}, required {report.min_pass_rate:.3f})",
        f"  golden {report.golden}; candidate {report.candidate}; {report.samples_per_case} sample(s) per case;"
        f" mean similarity >= {report.min_similarity}, assertion pass rate >= {report.min_assertion_rate}",
        "  (no token-level promise: the upstream offers no seed or version to pin)",
    ]
    if report.versions_changed:
        lines.append(f"Version identifiers changed since recording in {report.versions_changed} case(s)")
    for r in sorted(report.cases, key=lambda c: (c.passed, c.mean_similarity or -1.0)):
        mean = "n/a" if r.mean_similarity is None else f"{r.mean_similarity:.3f}"
        low = "n/a" if r.min_similarity is None else f"{r.min_similarity:.3f}"
        arate = "n/a" if r.assertion_pass_rate is None else f"{r.assertion_pass_rate:.3f}"
        lines.append(
            f"  {r.request_id}: {'pass' if r.passed else 'FAIL'}  similarity mean {mean} (min {low}),"
            f" assertions {r.assertion_passes}/{r.assertion_checks} ({arate})"
        )
        lines.extend(f"    assertion {name} failed on {n} sample(s)" for name, n in r.failed_assertions.items())
        lines.extend(f"    sample error: {e}" for e in r.errors[:3])
        if r.version_changed:
            lines.append(f"    versions: recorded {r.recorded_versions} → observed {r.observed_versions}")
    return "\n".join(lines) + "\n"
