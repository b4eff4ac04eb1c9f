"""Shadow traffic: a deterministic sample of live requests sent again to a candidate server, recorded as pairs.

The deterministic replay lane differs from production by design (one sequence at a time), so a release gate on
it alone cannot see what dynamic batching does to a candidate. Shadowing sends production's own requests, as
they come, to a candidate running the production configuration (batching on), and records its answers beside
production's:

    client's answer recorded (EnvelopeWriter.finish) -> offer(request id, envelope bytes)   [never awaits]
        sampled?  sha256(request id) < rate           (the same requests on every sidecar and every rerun)
        queue     bounded; full: dropped_queue
    worker (shadow_concurrency at once, so the candidate batches)
        the production envelope -> POST /v1/completions on the candidate: the recorded prompt token ids, the
        recorded sampling contract (seed by its scope), top-k logprobs and token ids asked back; its own
        timeout (shadow_timeout_s), its own connection pool
        -> the shadow envelope: the production envelope with the candidate's outcome, runtime fingerprint
           (`capture.request.runtime.RuntimeProbe` of the candidate, plus shadow_runtime_path), capture time and a
           `schemas.envelope.ShadowMarker` naming the production envelope; not flagged, no client request id
        -> the spool (then Kafka and S3, like every envelope), only while the spool holds less than
           shadow_spool_share of its bound (dropped_spool otherwise): shadows never fill the spool a guaranteed
           sidecar needs to serve
    every outcome is counted in ``reprolane_capture_shadow_total{outcome}``

Nothing here can delay, change or fail the client's answer: `ShadowTraffic.offer` is a hash and a
``put_nowait``; everything else runs in the workers, whose every failure (candidate down, slow, answering
garbage; a bug of ours) is counted and logged, never raised. A request that cannot be compared (an error
outcome, no prompt token ids, several prompts) is ``skipped``. A candidate that answers an error, or none within
its timeout, is recorded as a shadow envelope with that error outcome (the shadow report counts them).

The candidate is always asked through ``/v1/completions`` with token ids, also for a chat request: the rendered
prompt is what production computed on, and the candidate must compute on the same ids (its own chat template
could differ). The shadow keeps production's ``endpoint`` and artifacts (the candidate serves the same model
folder; a candidate with other weights is a gate of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any, Final

from capture.errors import UpstreamError, UpstreamTimeoutError
from capture.metrics import CaptureMetrics
from capture.protocol.output import OutputCollector
from capture.request.envelope_writer import SpoolLike
from capture.request.runtime import RuntimeProbe, load_runtime_file
from capture.request.upstream import Upstream
from capture.settings import CaptureSettings
from schemas import (
    CapturedError,
    CapturedOutput,
    Envelope,
    ExecutionContext,
    SamplingContract,
    ShadowMarker,
    Timings,
    decode_envelope,
)

log = logging.getLogger(__name__)

_JSON: Final = [(b"content-type", b"application/json")]
_ERROR_CHARS: Final = 2000
_MAX_ANSWER_BYTES: Final = 64 * 1024 * 1024


def sampled(request_id: str, rate: float) -> bool:
    """True for the requests a rate shadows: the first 8 bytes of sha256(request id) as a fraction below `rate`
    (the same request is shadowed or not on every sidecar, every time)."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    head = int.from_bytes(hashlib.sha256(request_id.encode("utf-8")).digest()[:8], "big")
    return head < rate * 2**64


def candidate_body(envelope: Envelope, model: str, top_k: int) -> dict[str, Any] | None:
    """The candidate's ``/v1/completions`` body for a production envelope, or None when it cannot be compared
    (no prompt token ids or contract, an error outcome, several prompts, logits processors: code, not data)."""
    sampling = envelope.sampling
    if envelope.prompt is None or sampling is None or envelope.more_prompts or sampling.logits_processors:
        return None
    if not isinstance(envelope.outcome, CapturedOutput):
        return None
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(envelope.prompt.token_ids),
        **_contract(sampling),
        "logprobs": sampling.logprobs or top_k,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stream": False,
    }
    for name, raw in sampling.extra.items():  # vLLM options the capture kept verbatim as JSON
        if name not in body:
            try:
                body[name] = json.loads(raw)
            except ValueError:
                return None
    return body


def _contract(s: SamplingContract) -> dict[str, Any]:
    """The contract as a vLLM server's request fields (``top_k`` -1 for none; a seed only when per request)."""
    fields: dict[str, Any] = {
        "n": s.n,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k if s.top_k > 0 else -1,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "min_tokens": s.min_tokens,
        "ignore_eos": s.ignore_eos,
    }
    if s.max_tokens is not None:
        fields["max_tokens"] = s.max_tokens
    if s.stop:
        fields["stop"] = list(s.stop)
    if s.stop_token_ids:
        fields["stop_token_ids"] = list(s.stop_token_ids)
    if s.seed is not None and s.seed_scope == "per_request":
        fields["seed"] = s.seed
    if s.logit_bias:
        fields["logit_bias"] = dict(s.logit_bias)
    return fields


class ShadowTraffic:
    """The sidecar's shadow sender (see the module docstring): `offer` on the request path, workers behind it."""

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        candidate: Upstream,
        runtime: RuntimeProbe,
        metrics: CaptureMetrics,
        spool: SpoolLike,
    ) -> None:
        """`settings`: the sidecar's (its ``shadow_*`` fields, the spool's bound, the audited top-k, the sidecar
        id); `candidate` and `runtime`: the candidate server and its runtime probe (`build_shadow` makes both)."""
        self.candidate = candidate
        self.runtime = runtime
        self.rate = settings.shadow_sample
        self.metrics = metrics
        self.spool = spool
        self._spool_limit = settings.spool_max_bytes * settings.shadow_spool_share
        self.timeout_s = settings.shadow_timeout_s
        self.model = settings.shadow_model
        self.top_k = max(settings.audit_top_logprobs, 1)
        self.sidecar_id = settings.sidecar_id
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(maxsize=settings.shadow_queue)
        self._concurrency = settings.shadow_concurrency
        self._workers: list[asyncio.Task[None]] = []
        self._counted: dict[str, Any] = {}
        self.in_flight = 0

    def _count(self, outcome: str) -> None:
        child = self._counted.get(outcome)
        if child is None:
            child = self._counted[outcome] = self.metrics.shadow_total.labels(outcome)
        child.inc()

    def offer(self, request_id: str, payload: bytes) -> None:
        """After a request's envelope is recorded: queue it for the candidate when sampled. Never blocks or
        raises (a full queue drops it, counted)."""
        if not sampled(request_id, self.rate):
            return
        try:
            self._queue.put_nowait((request_id, payload))
        except asyncio.QueueFull:
            self._count("dropped_queue")

    async def start(self) -> None:
        await self.candidate.start()
        await self.runtime.probe(self.candidate)
        self._workers = [asyncio.create_task(self._work()) for _ in range(self._concurrency)]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Let the queued shadows go out for up to `grace_s`, then drop the rest (counted) and close."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), grace_s)
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        while not self._queue.empty():
            self._queue.get_nowait()
            self._count("dropped_shutdown")
        await self.candidate.close()

    async def _work(self) -> None:
        while True:
            request_id, payload = await self._queue.get()
            self.in_flight += 1
            try:
                self._count(await self._shadow(payload))
            except asyncio.CancelledError:
                self._count("dropped_shutdown")
                raise
            except Exception:  # a bug of ours: the shadow is lost, the sidecar is not
                log.exception("shadow of request %s failed", request_id)
                self._count("shadow_error")
            finally:
                self.in_flight -= 1
                self._queue.task_done()

    async def _shadow(self, payload: bytes) -> str:
        production = decode_envelope(payload)
        body = candidate_body(production, self.model or production.model, self.top_k)
        if body is None:
            return "skipped"
        sent_at = datetime.now(UTC)
        t0 = time.perf_counter()
        outcome: CapturedOutput | CapturedError
        collector = OutputCollector("completions")
        result = "recorded"
        try:
            async with self.candidate.request(
                "POST", "/v1/completions", body=json.dumps(body).encode(), headers=_JSON, timeout_s=self.timeout_s
            ) as resp:
                content = await resp.read()
                status = resp.status
        except UpstreamTimeoutError as exc:
            outcome, result = self._error(sent_at, t0, "timeout", None, str(exc)), "timeout"
        except (UpstreamError, TimeoutError) as exc:
            outcome, result = self._error(sent_at, t0, "upstream_error", None, str(exc)), "candidate_error"
        else:
            outcome, result = self._answer(collector, sent_at, t0, status, content)
        if self.runtime.needs_probe:
            await self.runtime.probe(self.candidate)
        shadow = self._envelope(production, collector, outcome, payload)
        if self.spool.bytes >= self._spool_limit:
            return "dropped_spool"
        await self.spool.append_payload(shadow.canonical())
        return result

    def _answer(
        self, collector: OutputCollector, sent_at: datetime, t0: float, status: int, content: bytes
    ) -> tuple[CapturedOutput | CapturedError, str]:
        if status != 200:
            text = content[:_ERROR_CHARS].decode("utf-8", "replace")
            return self._error(sent_at, t0, "upstream_error", status, text), "candidate_error"
        try:
            if len(content) > _MAX_ANSWER_BYTES:
                raise ValueError("answer too large")
            answer = json.loads(content)
            if not isinstance(answer, dict):
                raise ValueError("not a JSON object")
            collector.add(answer)
            choices = collector.choices_record()
            if not choices:
                raise ValueError("no choices")
            timings = Timings(received_at=sent_at, upstream_ms=(time.perf_counter() - t0) * 1000.0)
            return CapturedOutput(choices=choices, timings=timings, usage=collector.usage), "recorded"
        except (ValueError, TypeError, AttributeError) as exc:
            return self._error(sent_at, t0, "upstream_error", 200, f"unusable answer: {exc}"), "candidate_error"

    @staticmethod
    def _error(sent_at: datetime, t0: float, kind: Any, status: int | None, message: str) -> CapturedError:
        timings = Timings(received_at=sent_at, upstream_ms=(time.perf_counter() - t0) * 1000.0)
        return CapturedError(error_type=kind, status_code=status, message=message[:_ERROR_CHARS] or kind,
                             timings=timings)  # fmt: skip

    def _envelope(
        self, production: Envelope, collector: OutputCollector, outcome: CapturedOutput | CapturedError, payload: bytes
    ) -> Envelope:
        marker = ShadowMarker(
            production_envelope_id=hashlib.sha256(payload).hexdigest(),
            candidate=self.candidate.base_url,
        )
        update = {
            "captured_at": datetime.now(UTC),
            "flagged": False,
            "flag_reason": None,
            "client_request_id": None,
            "runtime": self.runtime.fingerprint(collector.system_fingerprint),
            "context": ExecutionContext(
                in_flight_at_start=self.in_flight, in_flight_at_end=self.in_flight, sidecar_id=self.sidecar_id
            ),
            "outcome": outcome,
            "shadow": marker,
        }
        data = {name: getattr(production, name) for name in Envelope.model_fields}
        return Envelope.model_validate({**data, **update})


def build_shadow(settings: CaptureSettings, *, spool: SpoolLike, metrics: CaptureMetrics) -> ShadowTraffic | None:
    """The sidecar's shadow sender from its settings; None without ``shadow_upstream`` or with a zero sample.
    Reads the candidate's runtime file now, so a bad file fails before serving."""
    if settings.shadow_upstream is None or settings.shadow_sample <= 0.0:
        return None
    return ShadowTraffic(
        settings,
        candidate=Upstream(settings.shadow_upstream, timeout_s=settings.shadow_timeout_s),
        runtime=RuntimeProbe(load_runtime_file(settings.shadow_runtime_path)),
        metrics=metrics,
        spool=spool,
    )
