"""Writes each request's envelope into the spool, per the capture mode: a finished (or refused) request becomes
an envelope (its canonical bytes: `capture.request.assembly.build_envelope_bytes`), appended to the spool.

- ``guaranteed``: a stream's *started* record (`EnvelopeWriter.record_started`) is durable before the request
  goes upstream, so no streamed byte reaches a client unrecorded (a spool that cannot take it refuses the request
  with 503 before upstream sees it); the proxy awaits `EnvelopeWriter.finish` before it releases the response
  (the stream's last event), and that envelope supersedes the started one;
  `SpoolUnavailableError` reaches the answer flow, which answers 503 instead of serving an unrecorded answer.
- ``best_effort``: the proxy hands the same coroutine to `later` after the response is released; it runs as a
  background task kept in a set (so shutdown can `drain` it); a full spool counts
  ``envelopes_dropped_total`` and logs one line per lost envelope.

With shadow traffic on (`capture.request.shadow`), each finished request's envelope is offered to `shadow` once spooled
(a hash and a ``put_nowait``: the answer never waits on the candidate).

When upstream did not return ``prompt_token_ids`` the prompt is tokenized through upstream's ``/tokenize``
and the record says so (``source="tokenize"``); a ``/v1/messages`` request (whose server returns no token ids)
has its prompt tokenized from the messages as vLLM converts them and its answer's text re-tokenized, and its
envelope's ``capture_limits`` say so (`capture.protocol.messages`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from capture.errors import SpoolUnavailableError, UpstreamError
from capture.metrics import CaptureMetrics
from capture.protocol.audit_fields import Prepared
from capture.protocol.endpoints import ENDPOINTS
from capture.protocol.output import OutputCollector
from capture.request.assembly import (
    STARTED,
    EnvelopeInputs,
    Failure,
    RequestContext,
    build_envelope_bytes,
    prompt_record,
)
from capture.request.edge import dumps
from capture.request.runtime import Artifacts, RuntimeProbe
from capture.request.telemetry import CaptureTelemetry
from capture.request.upstream import Upstream
from schemas import PromptRecord, RuntimeFingerprint
from schemas.schedule_delivery import ScheduleRef, external_request_id_for

log = logging.getLogger(__name__)


class SpoolLike(Protocol):
    """What the sidecar needs of `capture.spool.Spool` on the request path."""

    async def append_payload(self, payload: bytes) -> None:
        """Append one envelope's canonical bytes; return once they are durable."""
        ...

    @property
    def bytes(self) -> int: ...


class ShadowOffer(Protocol):
    """What the writer needs of `capture.request.shadow.ShadowTraffic`: take a recorded envelope, never block or
    raise."""

    def offer(self, request_id: str, payload: bytes) -> None: ...


@dataclass(kw_only=True, eq=False)
class EnvelopeWriter:
    """Builds the envelopes of one sidecar's requests and appends them to its spool, in the order its mode asks."""

    guaranteed: bool
    spool: SpoolLike
    metrics: CaptureMetrics
    artifacts: (
        Artifacts  # by the model a request names (a LoRA adapter's include it: `capture.request.runtime.Artifacts`)
    )
    runtime: RuntimeProbe
    upstream: Upstream
    sidecar_id: str
    #: Upstream records its engine schedule under this recorder name (`CaptureSettings.schedule_recorder`): each
    #: envelope of a request that went upstream then carries a `ScheduleRef` (the join: `schemas.schedule_delivery`).
    schedule_recorder: str | None = None
    shadow: ShadowOffer | None = None  # `capture.request.shadow.ShadowTraffic` when shadow traffic is on
    #: One span per spooled envelope when OpenTelemetry export is on (`capture.request.telemetry`); off: a no-op.
    telemetry: CaptureTelemetry = field(default_factory=lambda: CaptureTelemetry(None))
    background: set[asyncio.Task[None]] = field(default_factory=set, init=False)  # `later`'s tasks in flight

    async def finish(
        self, ctx: RequestContext, prepared: Prepared, collector: OutputCollector, error: Failure | None, t0: float
    ) -> None:
        """Build the envelope of a request that reached upstream and spool it."""
        if self.runtime.needs_probe:
            await self.runtime.probe(self.upstream)
        prompt: PromptRecord | None = prompt_record(collector.prompt_token_ids, "upstream")
        more: tuple[PromptRecord, ...] | None = None
        if prepared.prompts > 1:
            found = [
                prompt_record(collector.choice_prompts.get(i * prepared.n), "upstream")
                for i in range(1, prepared.prompts)
            ]
            more = tuple(p for p in found if p is not None)
            if len(more) != len(found):  # a later prompt's ids are unknown: no prompt is recorded as if alone
                prompt, more = None, None
        elif prompt is None:
            prompt = prompt_record(await self._tokenize(prepared), "tokenize")
        limits = set(prepared.limits) | collector.limits
        protocol = ENDPOINTS[prepared.endpoint]
        if protocol.tokenizes_answer:
            await self._answer_ids(prepared, collector)
        if prompt is None and protocol.unrendered is not None:
            limits.add(protocol.unrendered)
        if self.guaranteed:
            ctx.added_ms = max((time.perf_counter() - t0) * 1000.0 - ctx.upstream_ms, 0.0)
        try:
            runtime = self.runtime.fingerprint(collector.system_fingerprint, collector.vendor_version())
            inputs = self._inputs(ctx, prepared, runtime, collector, error, prompt, more, tuple(sorted(limits)))
            payload = build_envelope_bytes(inputs)
        except Exception as exc:  # a bug of ours must not cost the audit record: keep what is certain
            log.exception("request %s: its envelope could not be built; recording the attempt", ctx.request_id)
            failure: Failure = ("proxy_error", None, f"the sidecar could not record the answer: {type(exc).__name__}")
            inputs = self._attempt_inputs(ctx, failure, prepared.model)
            payload = build_envelope_bytes(inputs)
        await self.append(ctx.request_id, payload)
        self.telemetry.captured(inputs, payload)
        if self.shadow is not None and error is None:
            self.shadow.offer(ctx.request_id, payload)

    def _inputs(
        self,
        ctx: RequestContext,
        prepared: Prepared,
        runtime: RuntimeFingerprint,
        collector: OutputCollector | None,
        error: Failure | None,
        prompt: PromptRecord | None = None,
        more: tuple[PromptRecord, ...] | None = None,
        limits: tuple[str, ...] = (),
    ) -> EnvelopeInputs:
        """What the request's envelope is made of, as gathered so far (built now: ``captured_at``)."""
        return EnvelopeInputs(
            ctx,
            model=prepared.model,
            artifacts=self.artifacts.of(prepared.model),
            runtime=runtime,
            prompt=prompt,
            more_prompts=more,
            sampling=prepared.sampling,
            collector=collector,
            error=error,
            captured_at=datetime.now(UTC),
            sidecar_id=self.sidecar_id,
            schedule=self._schedule_ref(ctx),
            limits=limits or prepared.limits,
        )

    def _schedule_ref(self, ctx: RequestContext) -> ScheduleRef | None:
        """Where the schedule of a request that went upstream is: its engine request is named after the request
        id the sidecar forwarded (`capture.request.edge.forward_headers`)."""
        if self.schedule_recorder is None or ctx.endpoint not in ("chat.completions", "completions"):
            return None  # vLLM names a Responses or Messages request's engine request after no id of ours
        return ScheduleRef(
            external_request_id=external_request_id_for(ctx.endpoint, ctx.request_id), recorder=self.schedule_recorder
        )

    async def record_started(self, ctx: RequestContext, prepared: Prepared, in_flight: int) -> None:
        """Guaranteed mode, before a stream goes upstream: the request's *started* record (its contract as known
        before upstream answers, outcome ``incomplete``: `capture.request.assembly.STARTED`), durable when this returns.

        Raises what `SpoolLike.append_payload` raises when the spool cannot take it (`SpoolUnavailableError`,
        `SpoolCorruptError`): the request is then refused before upstream sees it. The envelope `finish` writes
        later, with the same request id, supersedes this one.
        """
        ctx.in_flight_at_end = in_flight
        try:
            payload = build_envelope_bytes(self._inputs(ctx, prepared, self.runtime.fingerprint(None), None, STARTED))
        except Exception:  # a bug of ours: keep what the request's context alone says
            log.exception("request %s: its started record could not be built; recording the attempt", ctx.request_id)
            payload = build_envelope_bytes(self._attempt_inputs(ctx, STARTED, prepared.model))
        await self.spool.append_payload(payload)

    async def record_refused(self, ctx: RequestContext, error: Failure, t0: float) -> None:
        """An attempt the sidecar refused before upstream saw it (413, bad JSON, bad headers).

        The response is already decided, so even in guaranteed mode a full spool only logs here.
        """
        ctx.added_ms = (time.perf_counter() - t0) * 1000.0
        ctx.recorded = True
        inputs = self._attempt_inputs(ctx, error, "unknown")
        payload = build_envelope_bytes(inputs)
        if not self.guaranteed:
            self.later(self._append_refused(inputs, payload))
            return
        try:
            await self._append_refused(inputs, payload)
        except SpoolUnavailableError as exc:
            log.error("envelope of refused request %s not recorded: %s", ctx.request_id, exc)

    async def _append_refused(self, inputs: EnvelopeInputs, payload: bytes) -> None:
        await self.append(inputs.ctx.request_id, payload)
        self.telemetry.captured(inputs, payload)

    def _attempt_inputs(self, ctx: RequestContext, error: Failure, model: str) -> EnvelopeInputs:
        """An error envelope with what the request's context alone says (no prompt, contract or output)."""
        return EnvelopeInputs(
            ctx,
            model=model,
            artifacts=self.artifacts.of(model),
            runtime=self.runtime.fingerprint(None),
            prompt=None,
            sampling=None,
            collector=None,
            error=error,
            captured_at=datetime.now(UTC),
            sidecar_id=self.sidecar_id,
        )

    async def append(self, request_id: str, payload: bytes) -> None:
        """Spool one envelope (its canonical bytes). Guaranteed: raises `SpoolUnavailableError` (`SpoolFullError`
        at the bound or on a full disk). Best effort: counts and logs the drop instead."""
        if self.guaranteed:
            await self.spool.append_payload(payload)
            return
        try:
            await self.spool.append_payload(payload)
        except SpoolUnavailableError as exc:
            self.metrics.envelopes_dropped_total.inc()
            log.error("spool refused (best_effort): envelope of request %s dropped: %s", request_id, exc)

    def later(self, work: Awaitable[None]) -> None:
        """Run a recording in the background, tracked until it ends."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("recording an envelope failed: %s: %s", type(exc).__name__, exc)

    async def drain(self) -> None:
        """Wait for every background recording (shutdown)."""
        while self.background:
            await asyncio.gather(*list(self.background), return_exceptions=True)

    async def _answer_ids(self, prepared: Prepared, collector: OutputCollector) -> None:
        """An answer's token ids, tokenized from its text (`EndpointProtocol.tokenizes_answer`: Messages returns
        none)."""
        acc = collector.choices.get(0)
        if acc is not None and not acc.token_ids and acc.text:
            doc = {
                "model": prepared.upstream_body.get("model"),
                "prompt": "".join(acc.text),
                "add_special_tokens": False,
            }
            acc.token_ids.extend(await self._tokens(doc) or ())

    async def _tokenize(self, prepared: Prepared) -> list[int] | None:
        """The prompt's token ids from upstream's ``/tokenize`` of the request, rendered as upstream renders it
        (`capture.protocol.endpoints.EndpointProtocol.tokenize_doc`); None when that cannot be done."""
        body = prepared.upstream_body
        doc = ENDPOINTS[prepared.endpoint].tokenize_doc(body)
        return None if doc is None else await self._tokens({"model": body.get("model"), **doc})

    async def _tokens(self, doc: dict[str, Any]) -> list[int] | None:
        """Upstream's ``/tokenize`` of `doc`, or None when it cannot say."""
        try:
            status, answer = await self.upstream.post_json("/tokenize", dumps(doc))
        except UpstreamError:
            return None
        tokens = answer.get("tokens") if status == 200 and isinstance(answer, dict) else None
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) else None
