"""Assembling the envelope of one request from what the proxy gathered (pure: no IO, no clock).

`RequestContext` is what the proxy knows of a request before upstream answers, plus the timings after.
`EnvelopeInputs` holds it all: the `RequestContext`, the model name, the artifact hashes and runtime fingerprint,
the prompt record, the sampling contract, the `OutputCollector` (None when upstream never saw the request), the
failure if any, the capture time and the sidecar id. Three builders, one result:

- `build_envelope_bytes`: the canonical bytes, what the spool stores, on the sidecar's hot path. The envelope
  is validated by pydantic without its per-token logprobs (a dozen records, not one per token and per
  alternative) and the logprobs are checked value by value and written as canonical text by msgspec straight
  from the collector's rows (`OutputCollector.logprobs_texts`, `schemas.envelope_codec.steps_canonical_text`).
  Anything else takes `build_envelope`.
- `build_envelope`: the `schemas.Envelope`, validated once by pydantic-core from plain data; when that fails
  (an infinite logprob, a negative token id, a value of the wrong type from upstream) it takes
  `build_envelope_checked`.
- `build_envelope_checked`: one model at a time; a choice whose logprobs do not validate keeps its token ids
  without logprobs; anything else invalid raises `ValidationError`. The reference the others must equal.

``build_envelope_bytes(i) == build_envelope(i).canonical() == build_envelope_checked(i).canonical()`` for every
input, bad upstream values included (tests/capture/request/test_assembly.py, on random answers with bad values planted);
benchmarks/bench_envelope.py and BENCHMARKS.md ("Capture sidecar") give the costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, TypeAlias

from pydantic import ValidationError

from capture.protocol import Endpoint
from capture.protocol.output import OutputCollector
from capture.request.policy import FlagDecision
from schemas import (
    ArtifactHashes,
    Envelope,
    PromptRecord,
    RuntimeFingerprint,
    SamplingContract,
    WorkflowRef,
)
from schemas import envelope as envelope_schema
from schemas.envelope_codec import canonical_with_logprobs
from schemas.schedule_delivery import ScheduleRef

ErrorType: TypeAlias = envelope_schema.ErrorType
Failure = tuple[ErrorType, int | None, str]
"""Why a request has no complete output: (error type, HTTP status when there was one, message)."""

_NO_CHOICES: Final[Failure] = ("proxy_error", None, "upstream answered without choices")
STARTED: Final[Failure] = (
    "incomplete",
    None,
    "started: recorded before the answer was relayed (guaranteed mode); the envelope with this request id that "
    "follows says how it ended, and none follows only when the sidecar stopped mid-answer",
)
"""The outcome of a started record (`schemas.envelope.ErrorType`'s ``incomplete``)."""


@dataclass(slots=True)
class RequestContext:
    """Everything about one request that is known before upstream answers, plus the timings after."""

    request_id: str
    received_at: datetime
    tenant: str
    workflow: WorkflowRef | None
    flag: FlagDecision
    endpoint: Endpoint
    stream: bool
    in_flight_at_start: int
    in_flight_at_end: int = 0
    client_request_id: str | None = None
    body_sha256: str | None = None
    upstream_ms: float = 0.0
    first_token_ms: float | None = None
    added_ms: float | None = None
    traceparent: tuple[int, int, int] | None = None  # the caller's trace context (`capture.request.telemetry`), if any
    recorded: bool = False  # its envelope was handed to the envelope writer (the proxy's last-resort handler asks)


@dataclass(frozen=True, slots=True)
class EnvelopeInputs:
    """Everything one envelope is made of."""

    ctx: RequestContext
    model: str
    artifacts: ArtifactHashes
    runtime: RuntimeFingerprint
    prompt: PromptRecord | None
    sampling: SamplingContract | None
    collector: OutputCollector | None
    error: Failure | None
    captured_at: datetime
    sidecar_id: str
    more_prompts: tuple[PromptRecord, ...] | None = None
    schedule: ScheduleRef | None = None
    limits: tuple[str, ...] = ()  # `Envelope.capture_limits` (none: left out)


def prompt_record(token_ids: list[int] | None, source: Literal["upstream", "tokenize"]) -> PromptRecord | None:
    """The prompt's token ids as recorded (None when there are none, or they are not valid token ids)."""
    if not token_ids:
        return None
    try:
        return PromptRecord(token_ids=tuple(token_ids), source=source)
    except ValidationError:
        return None


def build_envelope_bytes(inputs: EnvelopeInputs) -> bytes:
    """Exactly ``build_envelope(inputs).canonical()``, cheaper with logprobs (see the module docstring).

    No short-lived record per token and per alternative also means less work for the garbage collector while
    requests are in flight.
    """
    collector = inputs.collector
    texts = collector.logprobs_texts() if collector is not None else None
    if collector is not None and texts is not None and any(text is not None for text in texts):
        doc = _envelope_doc(inputs, collector.choices_data(logprobs=False))
        try:
            data = canonical_with_logprobs(Envelope.model_validate(doc), texts)
        except ValidationError:
            data = None
        if data is not None:
            return data
    return build_envelope(inputs).canonical()


def build_envelope(inputs: EnvelopeInputs) -> Envelope:
    """The envelope: an output when upstream completed the request, else an error with what was partial.

    The whole envelope is validated once, by pydantic-core, from plain data (faster than a model constructor
    in Python per token and per alternative). Nothing is validated less: the same field rules apply to every
    value. When that fails, `build_envelope_checked` decides what survives.
    """
    choices = inputs.collector.choices_data() if inputs.collector is not None else []
    try:
        return Envelope.model_validate(_envelope_doc(inputs, choices))
    except ValidationError:
        pass  # rare: bad values from upstream; the careful path decides what survives
    return build_envelope_checked(inputs)


def build_envelope_checked(inputs: EnvelopeInputs) -> Envelope:
    """`build_envelope` one model at a time: a choice whose logprobs do not validate keeps its token ids
    without logprobs; anything else invalid raises `ValidationError`. The reference the fast paths must equal."""
    choices = inputs.collector.choices_record() if inputs.collector is not None else ()
    return Envelope.model_validate(_envelope_doc(inputs, choices))


def _envelope_doc(inputs: EnvelopeInputs, choices: Sequence[Any]) -> dict[str, Any]:
    """The envelope as plain data for `Envelope.model_validate` (`choices`: plain data, or `schemas.Choice`
    records already validated), written once for every builder: an output when upstream completed the request,
    else an error with what was partial."""
    collector = inputs.collector
    timings = _timings(inputs.ctx)
    outcome: dict[str, Any]
    if inputs.error is None and choices:
        outcome = {
            "kind": "output",
            "choices": choices,
            "timings": timings,
            "usage": collector.usage if collector else {},
        }
    else:
        kind, status, message = inputs.error or _NO_CHOICES
        outcome = {
            "kind": "error",
            "error_type": kind,
            "status_code": status,
            "message": message,
            "timings": timings,
            "partial": choices,
        }
    return {**_fields(inputs), "outcome": outcome}


def _fields(inputs: EnvelopeInputs) -> dict[str, Any]:
    """Every field of the envelope but its outcome, as plain data: written once, for every builder."""
    ctx = inputs.ctx
    return {
        "request_id": ctx.request_id,
        "client_request_id": ctx.client_request_id,
        "captured_at": inputs.captured_at,
        "tenant": ctx.tenant,
        "workflow": ctx.workflow,
        "flagged": ctx.flag.flagged,
        "flag_reason": ctx.flag.reason,
        "endpoint": ctx.endpoint,
        "model": inputs.model,
        "artifacts": inputs.artifacts,
        "request_body_sha256": ctx.body_sha256,
        "prompt": inputs.prompt,
        "sampling": inputs.sampling,
        "more_prompts": inputs.more_prompts,
        "runtime": inputs.runtime,
        "schedule": inputs.schedule,
        "context": {
            "in_flight_at_start": ctx.in_flight_at_start,
            "in_flight_at_end": ctx.in_flight_at_end,
            "stream": ctx.stream,
            "sidecar_id": inputs.sidecar_id,
        },
        "capture_limits": inputs.limits or None,
    }


def _timings(ctx: RequestContext) -> dict[str, Any]:
    return {
        "received_at": ctx.received_at,
        "upstream_ms": max(ctx.upstream_ms, 0.0),
        "first_token_ms": ctx.first_token_ms,
        "added_ms": ctx.added_ms,
    }
