"""Golden sets: the recorded requests a release gate replays, and where they come from.

A golden set is a sequence of `schemas.Envelope` records. Each one carries the prompt token ids, the sampling
contract, the runtime fingerprint and artifact hashes it was recorded under (the *baseline* environment), its
recorded output (the baseline's answer) and its declared ``target_level`` (the level the gate judges it by).
Two sources:

- a **JSONL file**: one envelope per line (the canonical JSON the capture side writes to S3, or any JSON that
  decodes as an envelope); blank lines and lines starting with ``#`` are ignored.
  ``reprolane release gate record-golden`` writes such files.
- an **S3 selector** read through `replayer.store.EnvelopeStore`:

  * ``s3:tenant=acme``            every envelope recorded for tenant ``acme`` (key order, see ``--limit``)
  * ``s3:workflow=ID``            every step of workflow ``ID``
  * ``s3:request-ids=a,b,c``      exactly those requests

A golden set must be replayable end to end: a line that is not an envelope is bad input; an envelope that cannot
be replayed (an error outcome, no prompt token ids) is excluded and named (`GoldenSet.excluded`), and a set
with nothing left is bad input. Duplicate envelopes (same envelope id) collapse to one.

`record_envelope` turns one lane output into a golden envelope (the CI path: run a workload on a lane once,
keep what it said as the baseline).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from replayer.errors import GateInputError, ReplayerError
from replayer.selection import not_replayable_reason
from replayer.store import EnvelopeStore
from schemas import (
    ArtifactHashes,
    CapturedOutput,
    Choice,
    ContractError,
    Envelope,
    EnvironmentFingerprint,
    ExecutionContext,
    PromptRecord,
    ReplayedOutput,
    ReproLevel,
    RuntimeFingerprint,
    SamplingContract,
    Timings,
    decode_envelope,
)

__all__ = [
    "GoldenSet",
    "S3Selector",
    "golden_environment",
    "load_golden_file",
    "load_golden_s3",
    "parse_s3_selector",
    "record_envelope",
    "write_golden",
]

SelectorKind = Literal["tenant", "workflow", "request-ids"]


@dataclass(frozen=True)
class S3Selector:
    kind: SelectorKind
    values: tuple[str, ...]

    def __str__(self) -> str:
        return f"s3:{self.kind}={','.join(self.values)}"


@dataclass(frozen=True)
class GoldenSet:
    """The replayable envelopes of a golden set, and those left out with the reason."""

    source: str
    envelopes: tuple[Envelope, ...]
    excluded: tuple[tuple[str, str], ...] = ()  # (request_id, reason)


def parse_s3_selector(text: str) -> S3Selector:
    """``s3:tenant=T`` | ``s3:workflow=ID`` | ``s3:request-ids=a,b``; `GateInputError` otherwise."""
    body = text.removeprefix("s3:")
    kind, sep, rest = body.partition("=")
    values = tuple(v.strip() for v in rest.split(",") if v.strip())
    if not text.startswith("s3:") or not sep or kind not in ("tenant", "workflow", "request-ids") or not values:
        raise GateInputError(f"golden selector {text!r}: expected s3:tenant=T, s3:workflow=ID or s3:request-ids=a,b")
    if kind != "request-ids" and len(values) != 1:
        raise GateInputError(f"golden selector {text!r}: {kind} takes one value")
    return S3Selector(kind, values)  # type: ignore[arg-type]  # kind checked above


def _finish(source: str, envelopes: Iterable[Envelope]) -> GoldenSet:
    seen: set[str] = set()
    kept: list[Envelope] = []
    excluded: list[tuple[str, str]] = []
    for env in envelopes:
        eid = env.envelope_id()
        if eid in seen:
            continue
        seen.add(eid)
        if env.shadow is not None:  # a candidate's answer (`capture.request.shadow`), not production's: no baseline
            excluded.append((env.request_id, "a shadow envelope (the candidate's answer, not production's)"))
        elif env.replayable:
            kept.append(env)
        else:
            excluded.append((env.request_id, not_replayable_reason(env)))
    if not kept:
        why = f" ({len(excluded)} not replayable)" if excluded else ""
        raise GateInputError(f"golden set {source}: no replayable envelope{why}")
    return GoldenSet(source, tuple(kept), tuple(excluded))


def load_golden_file(path: Path) -> GoldenSet:
    """Envelopes from a JSONL file (see module docstring); `GateInputError` names the bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise GateInputError(f"cannot read golden set {path}: {exc}") from exc
    envelopes = []
    for no, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            envelopes.append(decode_envelope(line))
        except ContractError as exc:
            raise GateInputError(f"golden set {path} line {no}: {exc}".splitlines()[0]) from exc
    return _finish(str(path), envelopes)


def load_golden_s3(store: EnvelopeStore, selector: S3Selector, *, limit: int | None = None) -> GoldenSet:
    """Envelopes selected in the audit bucket; store errors become `GateInputError` (no verdict possible)."""
    try:
        if selector.kind == "tenant":
            envelopes = store.list_tenant(selector.values[0], limit=limit)
        elif selector.kind == "workflow":
            envelopes = store.list_workflow(selector.values[0])
        else:
            envelopes = [store.get_by_request_id(rid) for rid in selector.values]
    except ReplayerError as exc:
        raise GateInputError(f"golden set {selector}: {exc}") from exc
    return _finish(str(selector), envelopes[:limit] if limit is not None else envelopes)


def write_golden(path: Path, envelopes: Sequence[Envelope]) -> None:
    """One canonical envelope per line (the bytes S3 holds), written whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(b"".join(env.canonical() + b"\n" for env in envelopes))
        tmp.replace(path)
    except OSError as exc:
        raise GateInputError(f"cannot write golden set {path}: {exc}") from exc


def golden_environment(golden: GoldenSet) -> EnvironmentFingerprint:
    """The baseline environment the golden set was recorded in: its envelopes' artifacts + runtime.

    Every envelope must share one environment (sha256 of artifacts + runtime, see
    `schemas.EnvironmentFingerprint.sha256`); a mixed set is bad input for ``--baseline golden`` (pass the
    baseline fingerprint file instead).
    """
    envs: dict[str, EnvironmentFingerprint] = {}
    for env in golden.envelopes:
        fp = EnvironmentFingerprint(
            model_name=env.model,
            artifacts=env.artifacts,
            runtime=env.runtime,
            taken_at=env.captured_at,
            source=f"golden:{golden.source}",
        )
        envs.setdefault(fp.sha256(), fp)
    if len(envs) > 1:
        raise GateInputError(
            f"golden set {golden.source} mixes {len(envs)} recorded environments; pass --baseline FILE"
        )
    return next(iter(envs.values()))


def record_envelope(
    *,
    request_id: str,
    prompt_token_ids: Sequence[int],
    prompt_text: str | None,
    sampling: SamplingContract,
    output: ReplayedOutput,
    runtime: RuntimeFingerprint,
    artifacts: ArtifactHashes,
    model: str,
    target_level: ReproLevel = "token",
    tenant: str = "golden",
    upstream_ms: float = 0.0,
    captured_at: datetime | None = None,
) -> Envelope:
    """A golden envelope from one lane output: the lane's fingerprint becomes the recorded runtime."""
    at = captured_at or datetime.now(UTC)
    body = json.dumps(
        {"model": model, "prompt": list(prompt_token_ids), **sampling.model_dump(mode="json")}, sort_keys=True
    )
    return Envelope(
        request_id=request_id,
        captured_at=at,
        tenant=tenant,
        flagged=True,
        flag_reason="header",
        target_level=target_level,
        endpoint="completions",
        model=model,
        artifacts=artifacts,
        request_body_sha256=hashlib.sha256(body.encode("utf-8")).hexdigest(),
        prompt=PromptRecord(token_ids=tuple(prompt_token_ids), source="lane", text=prompt_text),
        sampling=sampling,
        runtime=runtime,
        context=ExecutionContext(in_flight_at_start=0, in_flight_at_end=0),
        outcome=CapturedOutput(
            choices=(
                Choice(
                    index=0,
                    token_ids=output.token_ids,
                    text=output.text,
                    finish_reason=output.finish_reason,
                    logprobs=output.logprobs,
                ),
            ),
            timings=Timings(received_at=at, upstream_ms=max(upstream_ms, 0.0)),
            usage={"prompt_tokens": len(prompt_token_ids), "completion_tokens": len(output.token_ids)},
        ),
    )
