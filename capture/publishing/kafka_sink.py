"""The Kafka sink: every spooled envelope onto a topic, at least once.

`KafkaSink` takes a batch of `capture.publishing.outgoing.Outgoing` records and either confirms *every* record or raises
`SinkError`; every aiokafka exception is translated here, so the publisher only ever sees `SinkError`.

Topic `schemas.layout.TOPIC_ENVELOPES`, key = the engine behind the sidecar (`CaptureSettings.kafka_key`: so one
member of the replayers' consumer group owns an engine's busy periods) or else the request id, value = the
envelope's bytes (compact or canonical JSON,
or its sealed record), headers ``reprolane-envelope-id``, ``reprolane-request-id``, ``reprolane-schema`` and
``reprolane-encoding``;
``acks="all"``, linger 5 ms, all sends of a batch awaited together. Idempotence is off on purpose: Tansu refuses
InitProducerId, and delivery is at-least-once anyway (duplicates collapse by envelope id downstream). An envelope
over `schemas.layout.CLAIM_CHECK_BYTES` is sent as a `schemas.claim_check.ClaimCheck` naming its envelope object
(header ``reprolane-claim-check``); the publisher sends such a batch to Kafka only after S3 stored it
(`capture.publishing.sinks.Sink.refers_to_objects`), so a reference never points at nothing.

A record Kafka refuses for good (record too large, invalid or corrupt record) is reported in `RecordsRefused`
once every other record of the batch is confirmed; the publisher quarantines it (`capture.publishing.quarantine`) and
sends it to the dead-letter topic (`KafkaSink.dead_letter`). Every other failure is a plain `SinkError`, retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from capture.errors import RecordsRefused, SinkError
from capture.publishing.outgoing import Outgoing
from capture.publishing.quarantine import Refusal
from infra.clients.kafka import aiokafka_kwargs, kafka_errors, start_client, stop_quietly
from schemas.claim_check import claim_check_for
from schemas.layout import (
    CLAIM_CHECK_BYTES,
    HEADER_CLAIM_CHECK,
    HEADER_DLQ_REASON,
    HEADER_DLQ_SINK,
    HEADER_ENCODING,
    HEADER_ENVELOPE_ID,
    HEADER_REQUEST_ID,
    HEADER_SCHEMA,
    MAX_MESSAGE_BYTES,
    TOPIC_DEAD_LETTER,
    TOPIC_ENVELOPES,
)

if TYPE_CHECKING:
    from capture.settings import CaptureSettings

log = logging.getLogger(__name__)

#: Kafka's INVALID_RECORD error code (aiokafka has no class for it: it arrives as a plain KafkaError).
_INVALID_RECORD = 87
#: Longest dead-letter reason header (a refusal message can quote a whole key).
_REASON_LIMIT = 1000


def _kafka_refusals() -> tuple[type[BaseException], ...]:
    """aiokafka's errors for a record the broker (or the producer's own size check) will never take."""
    from aiokafka.errors import (
        CorruptRecordException,
        InvalidMessageError,
        MessageSizeTooLargeError,
        RecordListTooLargeError,
        RecordTooLargeError,
    )

    return (
        MessageSizeTooLargeError,
        RecordTooLargeError,
        RecordListTooLargeError,
        InvalidMessageError,
        CorruptRecordException,
    )


class KafkaSink:
    name = "kafka"
    refers_to_objects = True

    def __init__(
        self,
        settings: CaptureSettings,
        *,
        topic: str = TOPIC_ENVELOPES,
        dead_letter_topic: str = TOPIC_DEAD_LETTER,
        request_timeout_ms: int = 10000,
    ):
        if not settings.kafka_bootstrap:
            raise SinkError("kafka_bootstrap is not set")
        self.topic = topic
        self.dead_letter_topic = dead_letter_topic
        self._settings = settings
        self._key = None if settings.kafka_key is None else settings.kafka_key.encode()  # None: the request id
        self._request_timeout_ms = request_timeout_ms
        self._producer: Any = None

    def _producer_kwargs(self) -> dict[str, Any]:
        return {
            **aiokafka_kwargs(self._settings),
            "acks": "all",
            "enable_idempotence": False,
            "linger_ms": 5,
            "max_request_size": MAX_MESSAGE_BYTES,  # aiokafka's 1 MiB default would strand large envelopes
            "compression_type": "gzip",  # JSON of token ids and logprobs shrinks 1.7-3.6x (benchmarks/envelope_size.py)
            "request_timeout_ms": self._request_timeout_ms,
            "retry_backoff_ms": 200,
            "client_id": f"reprolane-{self._settings.sidecar_id}",
        }

    async def _ensure_started(self) -> Any:
        from aiokafka import AIOKafkaProducer

        if self._producer is None:
            self._producer = await start_client(
                AIOKafkaProducer(**self._producer_kwargs()),
                what=f"kafka {self._settings.kafka_bootstrap}: cannot connect",
                error=SinkError,
            )
        return self._producer

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        producer = await self._ensure_started()
        refusals = _kafka_refusals()
        refused: dict[int, tuple[str, str]] = {}
        sent: list[tuple[Outgoing, Any]] = []
        try:
            for item in batch:
                value, headers = (
                    item.payload,
                    [
                        (HEADER_ENVELOPE_ID, item.envelope_id.encode()),
                        (HEADER_REQUEST_ID, item.request_id.encode()),
                        (HEADER_SCHEMA, item.schema_version.encode()),
                        (HEADER_ENCODING, item.encoding.encode()),
                    ],
                )
                if item.claim_checked:
                    value = claim_check_for(item.envelope_id, item.object_key, item.payload).encode()
                    headers.append((HEADER_CLAIM_CHECK, b"1"))
                try:
                    key = self._key or item.request_id.encode()
                    future = await producer.send(self.topic, value=value, key=key, headers=headers)
                except refusals as exc:  # the producer's own checks (max_request_size) refuse before sending
                    refused[item.seq] = (type(exc).__name__, f"kafka refused the record: {exc!r}"[:_REASON_LIMIT])
                    continue
                sent.append((item, future))
            results = await asyncio.gather(*(future for _, future in sent), return_exceptions=True)
        except kafka_errors() as exc:
            raise SinkError(f"kafka send to {self.topic} failed: {exc!r}") from exc
        failed: list[BaseException] = []
        for (item, _), result in zip(sent, results, strict=True):
            if isinstance(result, refusals) or getattr(result, "errno", None) == _INVALID_RECORD:
                refused[item.seq] = (type(result).__name__, f"kafka refused the record: {result!r}"[:_REASON_LIMIT])
            elif isinstance(result, BaseException):
                failed.append(result)
        if failed:
            raise SinkError(f"kafka: {len(failed)} of {len(batch)} sends to {self.topic} failed: {failed[0]!r}")
        if refused:
            raise RecordsRefused(self.name, refused)

    async def dead_letter(self, refusal: Refusal, *, timeout_s: float = 10.0) -> bool:
        """Send a refused record to the dead-letter topic (`TOPIC_DEAD_LETTER`) with its reason; False (logged)
        when Kafka cannot take it now (the local quarantine holds it either way). A value Kafka refuses for good
        (too large) is sent again empty: the headers still say what was refused and why."""
        headers = [
            (HEADER_DLQ_REASON, f"{refusal.code}: {refusal.reason}"[:_REASON_LIMIT].encode()),
            (HEADER_DLQ_SINK, refusal.sink.encode()),
            (HEADER_ENVELOPE_ID, (refusal.envelope_id or "").encode()),
        ]
        key = (refusal.request_id or "")[:256].encode() or None
        unsent: tuple[type[BaseException], ...] = (*kafka_errors(), SinkError, TimeoutError)
        values = [refusal.payload, b""] if len(refusal.payload) <= CLAIM_CHECK_BYTES else [b""]
        for value in values:
            try:
                producer = await self._ensure_started()
                future = await producer.send(self.dead_letter_topic, value=value, key=key, headers=headers)
                await asyncio.wait_for(future, timeout_s)
                return True
            except _kafka_refusals() as exc:
                log.warning("publisher: dead letter of seq %d refused with its value (%r)", refusal.seq, exc)
            except unsent as exc:
                log.warning("publisher: dead letter of seq %d not sent (%r); it stays in quarantine", refusal.seq, exc)
                return False
        return False

    async def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            await stop_quietly(producer)
