"""The replayer service: a FastStream Kafka consumer that replays envelopes and publishes divergence events.

Per envelope message (consumer group ``settings.group_id``, one message at a time, offsets committed by hand):

1. decode (a claim check, `schemas.claim_check`, is first resolved from S3 and its sha256 checked); bytes that
   are not JSON or not a valid envelope go to the dead-letter topic with the reason
   (headers ``reprolane-dlq-reason``, ``reprolane-dlq-source`` = ``topic/partition/offset``), then commit;
2. select (`replayer.selection`): not selected -> commit and skip; not replayable -> count, commit, skip;
3. choose the lane as every replay entry point does (`replayer.lane_choice`: the schedule lane when the
   envelope's schedule is there, else the one-at-a-time lane); if S3 already holds the result for (envelope id,
   that lane's fingerprint), take its event (a redelivery: nothing is replayed or counted again); otherwise
   replay in a worker thread (one replay at a time per process), store the result (first write wins) and count
   it;
4. publish the `DivergenceEvent` (every verdict, ``bitwise`` included) keyed by request id;
5. only then commit the offset.

A crash anywhere before 5 re-delivers the message; step 3 makes the redelivery idempotent, so nothing is lost and
nothing is counted twice (the event may be published twice, always with the same ``result_id``). A store, lane
or broker error rewinds the consumer to the message (after ``settings.retry_backoff_s``) instead of skipping it.

On-demand replays: a `schemas.ReplayRequest` on ``settings.replay_request_topic`` names a request id; the envelope
is looked up through the S3 request-id index and replayed regardless of selection, on the lane it asks for
(None: the same choice as the stream's; ``schedule``; or the service's one-at-a-time lane), with ``reply_to``
echoed in the event. An unknown request id, or a lane this process does not serve, goes to the dead-letter topic. With
``settings.replay_requests="signed"`` (the default) a request is acted on only when signed by a key of
``settings.replay_request_keys_path`` that has the ``replay`` role, within ``settings.replay_request_window_s``
(`schemas.replay_auth`); anything else is dead-lettered as ``unauthorised`` and nothing is replayed. No keys file
means every request is refused; ``"open"`` (local development only) acts on any request.

Service heartbeats (not Kafka's consumer heartbeats): from start to stop the service publishes a
`schemas.replay.ReplayerHeartbeat` (its group, and every lane it answers with: the one-at-a-time lane and each
schedule lane built so far, with their fingerprints) on ``settings.service_heartbeat_topic`` every
``settings.service_heartbeat_interval_s``, at once when it has built a new schedule lane (before the answer that
lane gave is published, so a client that reads the heartbeat again finds it), and one marked ``stopping`` when it
stops, so ``reprolane replay request`` knows whether to ask it and whose answers to take (`replayer.on_demand`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka.errors import KafkaError
from faststream import AckPolicy
from faststream.kafka import KafkaBroker
from faststream.kafka.annotations import KafkaMessage

from infra.clients.kafka import faststream_security
from infra.clients.shutdown import stop_on_signals
from replayer.errors import EnvelopeNotFoundError, LaneUnavailableError, NotReplayableError, StoreError
from replayer.lane_choice import LaneChoice, Replayed, keep
from replayer.lanes.base import Lane
from replayer.metrics import ReplayerMetrics
from replayer.request_keys import load_replay_request_keys
from replayer.schedule.replay import Companions, ScheduleReplayer
from replayer.selection import not_replayable_reason, select
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from replayer.telemetry import ReplayTelemetry
from schemas import (
    ContractError,
    DivergenceEvent,
    Envelope,
    ReplayRequest,
    ReplayResult,
    decode_envelope,
    decode_replay_request,
)
from schemas.claim_check import is_claim_check
from schemas.envelope_compact import decode_compact, is_compact
from schemas.layout import (
    HEADER_DLQ_REASON,
    HEADER_DLQ_SOURCE,
    HEADER_ENVELOPE_ID,
    HEADER_SCHEMA,
    MAX_MESSAGE_BYTES,
)
from schemas.replay import AdvertisedLane, ReplayerHeartbeat
from schemas.replay_auth import ReplayRequestKey, verify_replay_request
from schemas.sealed import is_sealed, redact_divergence_event

log = logging.getLogger("reprolane.replayer")

_REASON_LIMIT = 1000
REQUEST_FETCH_WAIT_MS = 50
_TRANSIENT = (StoreError, LaneUnavailableError, KafkaError, OSError)


@dataclass(frozen=True)
class Handled:
    """What became of one message (returned by the handlers, for logs and tests)."""

    outcome: str  # "replayed", "deduplicated", "not_selected", "not_replayable", "dead_letter"
    event: DivergenceEvent | None = None


class _DeadLetter(Exception):
    """Internal: the message must go to the dead-letter topic with this category and reason."""

    def __init__(self, category: str, reason: str) -> None:
        super().__init__(reason)
        self.category = category
        self.reason = reason


def _source(msg: Any) -> str:
    raw = msg.raw_message
    return f"{raw.topic}/{raw.partition}/{raw.offset}"


def _classify_undecodable(body: bytes, exc: ContractError) -> _DeadLetter:
    """Not an envelope's bytes at all ("undecodable": not JSON, a corrupt compact record) or a record that breaks
    the contract ("schema", naming the fields)."""
    if is_compact(body):
        try:
            body = decode_compact(body)
        except ContractError as corrupt:
            return _DeadLetter("undecodable", f"undecodable: {corrupt}")
    try:
        json.loads(body)
    except ValueError as not_json:  # UnicodeDecodeError is a ValueError
        return _DeadLetter("undecodable", f"undecodable: not JSON ({not_json})")
    return _DeadLetter("schema", f"schema: {exc}")


class ReplayerService:
    """The consumer (see module docstring). Use as ``async with ReplayerService(...) as svc`` or start()/stop().

    Tests pass a fake lane and a store over moto or SeaweedFS; `serve` builds the real ones.
    """

    def __init__(
        self,
        settings: ReplayerSettings,
        lane: Lane,
        store: EnvelopeStore,
        metrics: ReplayerMetrics | None = None,
        *,
        broker: KafkaBroker | None = None,
        schedule: ScheduleReplayer | None = None,
    ) -> None:
        self.settings = settings
        self.lane = lane
        self.store = store
        self.metrics = metrics if metrics is not None else ReplayerMetrics()
        self.telemetry = ReplayTelemetry.from_settings(settings, self.metrics.registry)  # off unless configured
        self.lane_fingerprint_sha256 = lane.fingerprint().sha256()
        self.choice = LaneChoice(settings, lambda: lane, schedule)
        self.choice.one_at_a_time()  # it is made already: advertised from the first heartbeat
        self._advertised: list[tuple[str, str]] = []
        self._lane_lock = asyncio.Lock()
        keys_path = settings.replay_request_keys_path
        signed = settings.replay_requests == "signed"
        self._request_keys: dict[str, ReplayRequestKey] | None = (
            load_replay_request_keys(keys_path) if signed and keys_path is not None else None
        )
        self.broker = broker if broker is not None else self._make_broker()
        self._heartbeats: asyncio.Task[None] | None = None
        common: dict[str, Any] = {
            "ack_policy": AckPolicy.MANUAL,
            "auto_offset_reset": settings.auto_offset_reset,
            "session_timeout_ms": settings.session_timeout_ms,
            "heartbeat_interval_ms": settings.heartbeat_interval_ms,
            "max_partition_fetch_bytes": MAX_MESSAGE_BYTES,
        }
        self.broker.subscriber(settings.envelope_topic, group_id=settings.group_id, **common)(self._on_envelope)
        # A requester waits for the answer: fetch often (the broker holds an empty fetch up to fetch_max_wait_ms).
        self.broker.subscriber(
            settings.replay_request_topic,
            group_id=settings.replay_request_group_id,
            fetch_max_wait_ms=REQUEST_FETCH_WAIT_MS,
            **common,
        )(self._on_replay_request)

    @property
    def schedule(self) -> ScheduleReplayer | None:
        """The schedule lanes' replayer (`LaneChoice.schedule`: the one choice of lane, tests swap it here)."""
        return self.choice.schedule

    @schedule.setter
    def schedule(self, schedule: ScheduleReplayer | None) -> None:
        self.choice.schedule = schedule

    def _make_broker(self) -> KafkaBroker:
        return KafkaBroker(
            self.settings.kafka_bootstrap,
            client_id="reprolane-replayer",
            security=faststream_security(self.settings),
            graceful_timeout=30.0,
            logger=log,
        )

    async def start(self) -> None:
        if self.settings.replay_requests == "open":
            log.warning("replayer: replay_requests=open: any writer of %s may ask for a replay (development only)",
                        self.settings.replay_request_topic)  # fmt: skip
        elif self._request_keys is None:
            log.warning("replayer: no replay_request_keys_path: every replay request on %s will be refused",
                        self.settings.replay_request_topic)  # fmt: skip
        await self.broker.start()
        self._heartbeats = asyncio.create_task(self._beat())

    async def stop(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeats
            self._heartbeats = None
            await self._heartbeat(stopping=True)
        await self.broker.stop()
        await asyncio.to_thread(self.telemetry.shutdown)

    async def _heartbeat(self, *, stopping: bool = False) -> None:
        """Say on the heartbeat topic that this service serves on-demand requests (`replayer.on_demand` reads it);
        a failure is logged: the next beat may pass, and clients fall back to a lane of their own meanwhile."""
        self._advertised = self.choice.lanes()
        beat = ReplayerHeartbeat(
            group_id=self.settings.group_id,
            lane=self.lane.name,
            lane_fingerprint_sha256=self.lane_fingerprint_sha256,
            at=datetime.now(UTC),
            interval_s=self.settings.service_heartbeat_interval_s,
            stopping=stopping,
            lanes=tuple(AdvertisedLane(name=name, fingerprint_sha256=fp) for name, fp in self._advertised),
        )
        try:
            await self.broker.publish(
                beat.model_dump_json().encode("utf-8"),
                self.settings.service_heartbeat_topic,
                key=beat.group_id.encode(),
            )
        except (KafkaError, OSError) as exc:
            log.warning("replayer: heartbeat to %s failed: %s", self.settings.service_heartbeat_topic, exc)

    async def _beat(self) -> None:
        while True:
            await self._heartbeat()
            await asyncio.sleep(self.settings.service_heartbeat_interval_s)

    async def __aenter__(self) -> ReplayerService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- handlers --------------------------------------------------------------------------------------------

    async def _on_envelope(self, msg: KafkaMessage) -> None:
        await self._guarded(msg, self.handle_envelope_bytes)

    async def _on_replay_request(self, msg: KafkaMessage) -> None:
        await self._guarded(msg, self.handle_request_bytes)

    async def _guarded(self, msg: Any, handler: Callable[[bytes], Awaitable[Handled]]) -> None:
        """Run the handler; commit after success or a dead letter; rewind after a transient error.

        Anything else (a bug) is dead-lettered as ``internal`` rather than left uncommitted: with manual commits
        the next message's commit would otherwise skip it without a trace.
        """
        try:
            try:
                await handler(msg.body)
            except _DeadLetter as dead:
                await self._dead_letter(msg, dead)
            except _TRANSIENT:
                raise
            except Exception as exc:  # a bug must not silently skip a message: park it where it can be seen
                log.exception("replayer: unexpected error at %s", _source(msg))
                await self._dead_letter(msg, _DeadLetter("internal", f"internal: {type(exc).__name__}: {exc}"))
        except _TRANSIENT as exc:
            self.metrics.retries.labels(error=type(exc).__name__).inc()
            log.warning("replayer: %s at %s, will re-read: %s", type(exc).__name__, _source(msg), exc)
            await asyncio.sleep(self.settings.retry_backoff_s)
            await msg.nack()  # seek back to this message: it is read again, never skipped
            return
        try:
            await msg.ack()
        except KafkaError as exc:  # e.g. a rebalance took the partition: the new owner re-reads, idempotently
            log.warning("replayer: commit failed at %s: %s", _source(msg), exc)

    async def _dead_letter(self, msg: Any, dead: _DeadLetter) -> None:
        raw = msg.raw_message
        reason = dead.reason if len(dead.reason) <= _REASON_LIMIT else dead.reason[: _REASON_LIMIT - 1] + "…"
        await self.broker.publish(
            msg.body,
            self.settings.dead_letter_topic,
            key=raw.key,
            headers={HEADER_DLQ_REASON: reason, HEADER_DLQ_SOURCE: _source(msg)},
        )
        self.metrics.dead_letters.labels(reason=dead.category).inc()
        log.warning("replayer: dead letter from %s: %s", _source(msg), reason)

    # -- logic (public for tests that bypass Kafka) ----------------------------------------------------------

    async def handle_envelope_bytes(self, body: bytes) -> Handled:
        """One message of the envelope topic (raises `_DeadLetter` or a transient error; see `_guarded`).

        A sealed envelope (encrypted tenant) is opened through the store with its tenant's data key; one whose
        key was shredded, or that this replayer has no KEK for, is counted as not replayable and skipped. A claim
        check (an envelope too large for Kafka) is resolved from S3 first, its size and sha256 checked; a bad
        reference is dead-lettered (``claim_check``), an object not there yet is retried like any store error."""
        if is_claim_check(body):
            try:
                body = await asyncio.to_thread(self.store.resolve_claim_check, body)
            except ContractError as exc:
                raise _DeadLetter("claim_check", f"claim_check: {exc}") from exc
        try:
            if is_sealed(body):
                envelope = await asyncio.to_thread(self.store.decode_message, body)
            else:
                envelope = decode_envelope(body)
        except NotReplayableError as exc:
            self.metrics.not_replayable.inc()
            log.info("replayer: sealed envelope not replayable: %s", exc)
            return Handled("not_replayable")
        except ContractError as exc:
            raise _classify_undecodable(body, exc) from exc
        decision = select(envelope, self.settings)
        if decision == "not_selected":
            self.metrics.not_selected.inc()
            return Handled("not_selected")
        if decision == "not_replayable":
            self.metrics.not_replayable.inc()
            log.info("replayer: %s not replayable: %s", envelope.request_id, not_replayable_reason(envelope))
            return Handled("not_replayable")
        return await self.replay_and_publish(envelope)

    async def handle_request_bytes(self, body: bytes) -> Handled:
        """One message of the replay-request topic."""
        try:
            request = decode_replay_request(body)
        except ContractError as exc:
            raise _classify_undecodable(body, exc) from exc
        refused = self._refusal(request)
        if refused is not None:
            raise _DeadLetter("unauthorised", f"unauthorised: {refused}")
        wrong = self.choice.refusal(request.lane)
        if wrong is not None:
            raise _DeadLetter("wrong_lane", f"wrong_lane: {wrong}")
        try:
            envelope = await asyncio.to_thread(self.store.get_by_request_id, request.request_id)
        except EnvelopeNotFoundError as exc:
            raise _DeadLetter("not_found", f"not_found: {exc}") from exc
        except NotReplayableError as exc:  # e.g. a sealed envelope whose tenant key was shredded
            self.metrics.not_replayable.inc()
            raise _DeadLetter("not_replayable", f"not_replayable: {exc}") from exc
        if not envelope.replayable:
            self.metrics.not_replayable.inc()
            raise _DeadLetter("not_replayable", f"not_replayable: {not_replayable_reason(envelope)}")
        return await self.replay_and_publish(envelope, on_demand=True, reply_to=request.reply_to, lane=request.lane)

    def _refusal(self, request: ReplayRequest) -> str | None:
        """Why this process must not act on `request` (None: it may); never contains a secret."""
        if self.settings.replay_requests == "open":
            return None
        if self._request_keys is None:
            return "no replay_request_keys_path is configured: every request is refused"
        return verify_replay_request(request, self._request_keys, window_s=self.settings.replay_request_window_s)

    def _companions(self) -> Companions:
        """How a busy-period replay reads the period's other captured requests and keeps their results (called in
        the replay's worker thread: the store is blocking)."""

        def load(request_id: str) -> Envelope | None:
            try:
                envelope = self.store.get_by_request_id(request_id)
            except (EnvelopeNotFoundError, NotReplayableError, StoreError):
                return None
            return envelope if envelope.replayable else None

        def keep_member(envelope: Envelope, result: ReplayResult) -> None:
            stood, wrote = keep(self.store, envelope, Replayed(result, stored=False))
            if wrote:
                self.metrics.observe_replay(stood.event, stood.event.replay_ms / 1e3, envelope.runtime.sha256())

        return Companions(load, keep_member)

    async def replay_and_publish(
        self, envelope: Envelope, *, on_demand: bool = False, reply_to: str | None = None, lane: str | None = None
    ) -> Handled:
        """Steps 3 and 4 of the module docstring: the lane chosen by `LaneChoice` (``lane``: the one asked for, None:
        its choice), idempotent by (envelope id, that lane's fingerprint).

        On demand, a not-replayable envelope is dead-lettered (the requester is waiting for an answer);
        from the envelope stream it is only counted.
        """
        began = datetime.now(UTC)
        # an envelope's schedule is waited for (until shipped) before the lane is taken
        window = await asyncio.to_thread(self.choice.look, envelope, lane)
        replayed: Replayed | None = None
        if (window is None or isinstance(window, str)) and lane in (None, self.lane.name):  # one at a time
            existing = await asyncio.to_thread(self.store.get_result, envelope, self.lane_fingerprint_sha256)
            replayed = None if existing is None else Replayed(existing, stored=True)  # a redelivery: no lane wait
        seconds = 0.0
        if replayed is None:
            async with self._lane_lock:
                started = time.perf_counter()
                try:
                    replayed = await asyncio.to_thread(
                        self.choice.replay,
                        envelope,
                        lane=lane,
                        window=window,
                        stored=self.store.get_result,
                        companions=self._companions() if self.settings.replay_unit == "busy_period" else None,
                    )
                except NotReplayableError as exc:
                    self.metrics.not_replayable.inc()
                    log.info("replayer: %s not replayable: %s", envelope.request_id, exc)
                    if on_demand:
                        raise _DeadLetter("not_replayable", f"not_replayable: {exc}") from exc
                    return Handled("not_replayable")
                except _TRANSIENT:
                    raise
                except Exception as exc:  # a lane bug on this input: park it, keep consuming
                    raise _DeadLetter("replay_failed", f"replay_failed: {type(exc).__name__}: {exc}") from exc
                seconds = time.perf_counter() - started
        if self.choice.lanes() != self._advertised:  # a schedule lane was built: say so before it answers
            await self._heartbeat()
        result, wrote = await asyncio.to_thread(keep, self.store, envelope, replayed)
        event = result.event
        if wrote:
            outcome = "replayed"
            self.metrics.observe_replay(event, seconds, envelope.runtime.sha256())
        else:  # stored before (a redelivery), or another replayer stored it first: that result stands
            outcome = "deduplicated"
            self.metrics.deduplicated.inc()
        if reply_to is not None:
            event = event.model_copy(update={"reply_to": reply_to})
        if self.store.is_encrypted(envelope):  # no token of an encrypted tenant on Kafka: it is in the sealed result
            event = redact_divergence_event(event)
        await self.broker.publish(
            event.model_dump_json().encode("utf-8"),
            self.settings.divergence_topic,
            key=event.request_id.encode("utf-8"),
            headers={HEADER_ENVELOPE_ID: event.envelope_id, HEADER_SCHEMA: event.schema_version},
        )
        self.telemetry.replayed(envelope, event, outcome, began)
        return Handled(outcome, event)


async def run_until_signalled(service: ReplayerService) -> None:
    """Start the service and run until SIGINT or SIGTERM, then stop it (in-flight message finishes first)."""
    stop = stop_on_signals()
    async with service:
        log.info(
            "replayer: consuming %s as group %s on lane %s (%s)",
            service.settings.envelope_topic,
            service.settings.group_id,
            service.lane.name,
            service.lane_fingerprint_sha256[:12],
        )
        await stop.wait()


def serve(settings: ReplayerSettings) -> None:
    """`reprolane serve replayer`: start the lane, the store, the metrics endpoint and the consumer."""
    from replayer.lanes import make_lane

    store = EnvelopeStore.from_settings(settings)
    metrics = ReplayerMetrics()
    if settings.metrics_port is not None:
        metrics.serve(settings.metrics_port, addr=settings.metrics_host)
    lane = make_lane(settings)
    schedule = ScheduleReplayer(settings)  # loads a schedule lane only for an envelope that names a schedule
    try:
        asyncio.run(run_until_signalled(ReplayerService(settings, lane, store, metrics, schedule=schedule)))
    finally:
        schedule.close()
        lane.close()
