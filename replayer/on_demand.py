"""Replays in seconds: ask the running replayer service, which has its lane loaded, instead of loading one here.

A lane takes tens of seconds to load (a vLLM engine, a model), a short replay a fraction of one. The service
(`replayer.service`) keeps its lane loaded and consumes on-demand `schemas.ReplayRequest` messages; this is the
client side of that topic, used by ``reprolane replay request``:

1. **Is one running?** (`service_members`) The members of the service's replay-request consumer group
   (``ReplayerSettings.replay_request_group_id``), as the broker's group coordinator reports them. Chosen over a
   heartbeat object in S3: membership is what Kafka itself maintains (a crashed service leaves the group when
   its session times out, a stopped one at once), it needs no writes and no clock agreement, and it is exactly
   the question asked, "will someone consume this request?". A service joins the group only after its lane is
   loaded (`replayer.service.serve`), so a member is a loaded lane.
2. **Ask** (`ask_service`): sign the request (`schemas.replay_auth`, a key of the replay-request keys file,
   ``replay_request_key_id`` or its only key with the ``replay`` role; without a keys file the request goes
   unsigned, which only a service running with ``replay_requests=open`` acts on), with a fresh ``reply_to``.
3. **Wait** for the answer on the divergence topic: the service echoes ``reply_to`` in the `DivergenceEvent` it
   publishes, even when the result was already stored (a re-replay is deduplicated, and answered). A refusal is
   on the dead-letter topic: the request's own bytes with the reason header, matched by the same ``reply_to``,
   so a refused request fails at once with the service's reason instead of waiting out the timeout. Both
   topics are read from their end as it was *before* the request was sent, so the answer cannot be missed.
   The event (redacted for an encrypted tenant) then names the stored result, which the caller reads from S3
   (`replayer.store.EnvelopeStore.get_result`, opening a sealed one): Kafka says when, S3 holds what. Polling
   S3 alone was the alternative, but the result's key depends on the service's lane fingerprint, which the
   client does not know, and a poll cannot tell a refusal from a slow replay.

Every failure is a `ServiceReplayError` with the reason; the command decides whether to fall back to a lane of
its own (``--via auto``) or to stop (``--via service``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from infra.clients.kafka import aiokafka_kwargs, kafka_errors
from replayer.errors import ServiceReplayError
from replayer.request_keys import load_replay_request_keys
from replayer.settings import ReplayerSettings
from schemas import ContractError, DivergenceEvent, ReplayRequest, decode_divergence, decode_replay_request
from schemas.layout import HEADER_DLQ_REASON
from schemas.replay_auth import REPLAY_ROLE, sign_replay_request

if TYPE_CHECKING:
    from replayer.store import EnvelopeStore
    from schemas import Envelope, ReplayResult

#: How long the liveness check may take before the service is taken for absent.
LIVENESS_TIMEOUT_S = 5.0
#: How long ``replay request`` waits for the service's answer by default (it may be replaying another request).
DEFAULT_SERVICE_TIMEOUT_S = 30.0
#: ``--via``: the running service only, a lane loaded here only, or the service when one is running.
VIAS = ("auto", "service", "local")


async def _with_timeout(what: str, call: Any, timeout_s: float) -> Any:
    try:
        return await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        raise ServiceReplayError(f"{what}: no answer from Kafka in {timeout_s:.0f} s") from None
    except kafka_errors() as exc:
        raise ServiceReplayError(f"{what}: {type(exc).__name__}: {exc}") from exc


async def service_members(settings: ReplayerSettings) -> int:
    """How many replayer services consume the replay-request topic now (0: none); `ServiceReplayError` when
    Kafka cannot say."""
    from aiokafka.admin import AIOKafkaAdminClient

    group = settings.replay_request_group_id
    admin = AIOKafkaAdminClient(**aiokafka_kwargs(settings), request_timeout_ms=int(LIVENESS_TIMEOUT_S * 1000))
    try:
        await _with_timeout("the replayer service's liveness check", admin.start(), LIVENESS_TIMEOUT_S)
        responses = await _with_timeout(
            "the replayer service's liveness check", admin.describe_consumer_groups([group]), LIVENESS_TIMEOUT_S
        )
    finally:
        await admin.close()
    for response in responses:
        for error_code, group_id, state, _ptype, _protocol, members, *_rest in response.groups:
            if group_id == group and error_code == 0 and state not in ("Dead", "Empty"):
                return len(members)
    return 0


def sign(request: ReplayRequest, settings: ReplayerSettings) -> ReplayRequest:
    """`request` signed with the configured key (see the module docstring), or as it is without a keys file."""
    path = settings.replay_request_keys_path
    if path is None:
        return request
    keys = load_replay_request_keys(path)
    wanted = settings.replay_request_key_id
    if wanted is not None:
        if wanted not in keys:
            raise ServiceReplayError(f"replay_request_key_id: no key {wanted!r} in {path}")
        key_id = wanted
    else:
        usable = sorted(k for k, key in keys.items() if REPLAY_ROLE in key.roles)
        if len(usable) != 1:
            raise ServiceReplayError(f"{path} has {len(usable)} keys with the {REPLAY_ROLE!r} role: name the one "
                                     "to sign with (REPROLANE_REPLAYER_REPLAY_REQUEST_KEY_ID)")  # fmt: skip
        key_id = usable[0]
    return sign_replay_request(request, key_id, keys[key_id].secret)


async def ask_service(
    settings: ReplayerSettings, request_id: str, *, lane: str | None, timeout_s: float
) -> DivergenceEvent:
    """Ask the running service to replay `request_id` on `lane` and wait for its event (module docstring)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    reply_to = f"cli-{uuid.uuid4().hex}"
    request = sign(ReplayRequest(request_id=request_id, lane=lane, reply_to=reply_to), settings)
    answers = (settings.divergence_topic, settings.dead_letter_topic)
    deadline = time.monotonic() + timeout_s
    consumer = AIOKafkaConsumer(
        **aiokafka_kwargs(settings), group_id=None, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    producer = AIOKafkaProducer(**aiokafka_kwargs(settings), enable_idempotence=False, linger_ms=0)
    try:
        await _with_timeout("asking the replayer service", consumer.start(), timeout_s)
        partitions = [
            TopicPartition(topic, p) for topic in answers for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not partitions:
            raise ServiceReplayError(f"topics {', '.join(answers)} do not exist")
        consumer.assign(partitions)
        ends = await _with_timeout("asking the replayer service", consumer.end_offsets(partitions), timeout_s)
        for tp, offset in ends.items():
            consumer.seek(tp, offset)
        await _with_timeout("asking the replayer service", producer.start(), timeout_s)
        await _with_timeout(
            "sending the replay request",
            producer.send_and_wait(
                settings.replay_request_topic, request.model_dump_json().encode("utf-8"), key=request_id.encode()
            ),
            timeout_s,
        )
        while (left := deadline - time.monotonic()) > 0:
            batch = await _with_timeout(
                "waiting for the replayer service", consumer.getmany(timeout_ms=int(min(left, 0.2) * 1000)), left + 5
            )
            for tp, records in batch.items():
                for record in records:
                    answer = _answer(record, reply_to, is_dead_letter=tp.topic == settings.dead_letter_topic)
                    if answer is not None:
                        return answer
        raise ServiceReplayError(f"the replayer service did not answer request {request_id} in {timeout_s:.0f} s")
    finally:
        await producer.stop()
        await consumer.stop()


def _answer(record: Any, reply_to: str, *, is_dead_letter: bool) -> DivergenceEvent | None:
    """The event answering `reply_to`, None for anyone else's message; a dead letter of ours raises its reason.
    Messages of the topics are anyone's: what does not decode is not ours."""
    value = record.value
    if not isinstance(value, bytes):
        return None
    try:
        if not is_dead_letter:
            event = decode_divergence(value)
            return event if event.reply_to == reply_to else None
        request = decode_replay_request(value)
    except ContractError:
        return None
    if request.reply_to != reply_to:
        return None
    reason = dict(record.headers or ()).get(HEADER_DLQ_REASON, b"no reason given")
    text = reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
    raise ServiceReplayError(f"the replayer service refused the request: {text[:500]}")


async def _members_then_ask(settings: ReplayerSettings, request_id: str, timeout_s: float) -> DivergenceEvent:
    if await service_members(settings) == 0:
        raise ServiceReplayError(f"no replayer service is running (consumer group "
                                 f"{settings.replay_request_group_id} of {settings.replay_request_topic} has no "
                                 "members)")  # fmt: skip
    return await ask_service(settings, request_id, lane=settings.lane, timeout_s=timeout_s)


def replay_via_service(
    envelope: Envelope,
    store: EnvelopeStore,
    settings: ReplayerSettings,
    via: str,
    timeout_s: float,
    say: Callable[[str], None],
) -> ReplayResult | None:
    """The running service's result for `envelope` on ``settings.lane``, read from S3 once it answered; None
    (after `say`-ing why) when ``via`` is ``auto`` and the service is absent or failed: the caller loads a lane.
    With ``via`` ``service`` a failure is a `ServiceReplayError`."""
    started = time.perf_counter()
    try:
        event = asyncio.run(_members_then_ask(settings, envelope.request_id, timeout_s))
        result = store.get_result(envelope, event.lane_fingerprint_sha256)
        if result is None:
            raise ServiceReplayError(f"the replayer service answered, but result {event.result_id()} is not in S3")
    except ServiceReplayError as exc:
        if via == "service":
            raise
        say(f"reprolane: {exc}; replaying on a {settings.lane} lane loaded here instead (it takes a while to load)")
        return None
    say(f"reprolane: replayed by the running replayer service on lane {event.lane} "
        f"({(time.perf_counter() - started) * 1000:.0f} ms round trip)")  # fmt: skip
    return result
