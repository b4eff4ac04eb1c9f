"""Replays in seconds: ask the running replayer service, which has its lane loaded, instead of loading one here.

A lane takes tens of seconds to load (a vLLM engine, a model), a short replay a fraction of one. The service
(`replayer.service`) keeps its lane loaded and consumes on-demand `schemas.ReplayRequest` messages; this is the
client side of that topic, used by ``reprolane replay request``:

1. **Is one running?** (`live_service`) The service publishes a `schemas.replay.ReplayerHeartbeat` (its group,
   and every lane it answers with: its one-at-a-time lane and each schedule lane it has built, with their
   fingerprints) every few seconds, and a last one marked ``stopping`` when it stops; the client reads the newest
   records of the heartbeat topic and takes the service of its group (``settings.group_id``) for running when its
   newest heartbeat is not ``stopping`` and younger than a few intervals (a crash shows as silence). The service
   beats only once its lane is loaded, and the heartbeat names its one-at-a-time lane, so a client that wants
   another one-at-a-time lane does not ask. Kafka's own answer, the members of the service's replay-request consumer
   group, was the first choice (no extra topic), but Tansu, the local stack's broker, keeps a departed member in
   the group's description indefinitely, so a stopped service looked alive; and an S3 heartbeat object would be
   a write every few seconds into a bucket whose objects are locked for years.
2. **Ask** (`ask_service`): sign the request (`schemas.replay_auth`, a key of the replay-request keys file,
   ``replay_request_key_id`` or its only key with the ``replay`` role; without a keys file the request goes
   unsigned, which only a service running with ``replay_requests=open`` acts on), with a fresh ``reply_to``.
3. **Wait** for the answer on the divergence topic: the service echoes ``reply_to`` in the `DivergenceEvent` it
   publishes, even when the result was already stored (a re-replay is deduplicated, and answered). A refusal is
   on the dead-letter topic: the request's own bytes with the reason header, matched by the same ``reply_to``,
   so a refused request fails at once with the service's reason instead of waiting out the timeout. Both
   topics are read from their end as it was *before* the request was sent, so the answer cannot be missed.
   The event (redacted for an encrypted tenant) then names the stored result, which the caller reads from S3
   (`replayer.store.EnvelopeStore.get_result`, opening a sealed one): Kafka says when, S3 holds what. The
   event must be about this envelope, on the lane asked for, and name a lane fingerprint the service advertises
   (`accept`), so a forged answer on the divergence topic can at most point at this envelope's write-once result
   on one of the service's own lanes. The service chooses the lane as every entry point does
   (`replayer.lane_choice`), so its answer is often on a schedule lane it built for this very request: it beats
   at once when it builds one, before it answers, and a fingerprint the heartbeat read before asking did not
   name is looked for in a heartbeat read again, once. Polling
   S3 alone was the alternative (the heartbeat's lane fingerprint gives the result's key), but a poll cannot
   tell a refusal from a slow replay, and costs a request to S3 each time.

Every failure is a `ServiceReplayError` with the reason; the command decides whether to fall back to a lane of
its own (``--via auto``) or to stop (``--via service``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from infra.clients.kafka import aiokafka_kwargs, kafka_errors
from replayer.errors import ServiceReplayError
from replayer.lane_choice import SCHEDULE_LANE
from replayer.request_keys import load_replay_request_keys
from replayer.settings import ReplayerSettings
from schemas import ContractError, DivergenceEvent, ReplayRequest, decode_divergence, decode_replay_request
from schemas.layout import HEADER_DLQ_REASON
from schemas.replay import ReplayerHeartbeat, decode_heartbeat
from schemas.replay_auth import REPLAY_ROLE, sign_replay_request

if TYPE_CHECKING:
    from replayer.store import EnvelopeStore
    from schemas import Envelope, ReplayResult

_T = TypeVar("_T")

#: How long the liveness check may take before the service is taken for absent.
LIVENESS_TIMEOUT_S = 5.0
#: A service whose newest heartbeat is older than this many of its intervals is taken for absent (a crash).
STALE_INTERVALS = 3.0
#: How many of the newest records of each heartbeat partition are read (every service of every group beats there).
HEARTBEATS_READ = 256
#: How long the broker may hold an empty fetch of the client's consumers (the answer is waited for).
FETCH_WAIT_MS = 50
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


async def live_service(settings: ReplayerSettings) -> ReplayerHeartbeat | None:
    """The newest heartbeat of the service of ``settings.group_id`` when it says the service is running now (not
    stopping, younger than `STALE_INTERVALS` of its interval), else None; `ServiceReplayError` when Kafka
    cannot say."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    what = "the replayer service's liveness check"
    consumer = AIOKafkaConsumer(
        **aiokafka_kwargs(settings), group_id=None, enable_auto_commit=False, fetch_max_wait_ms=FETCH_WAIT_MS
    )
    newest: ReplayerHeartbeat | None = None
    try:
        await _with_timeout(what, consumer.start(), LIVENESS_TIMEOUT_S)
        topic = settings.service_heartbeat_topic
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not partitions:
            return None
        consumer.assign(partitions)
        starts = await _with_timeout(what, consumer.beginning_offsets(partitions), LIVENESS_TIMEOUT_S)
        ends = await _with_timeout(what, consumer.end_offsets(partitions), LIVENESS_TIMEOUT_S)
        pending = {tp for tp in partitions if ends[tp] > starts[tp]}
        for tp in pending:
            consumer.seek(tp, max(starts[tp], ends[tp] - HEARTBEATS_READ))
        deadline = time.monotonic() + LIVENESS_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            batch = await _with_timeout(what, consumer.getmany(*pending, timeout_ms=200), LIVENESS_TIMEOUT_S)
            for records in batch.values():
                for record in records:
                    beat = _heartbeat(record.value, settings.group_id)
                    if beat is not None and (newest is None or beat.at >= newest.at):
                        newest = beat
            for tp in list(pending):
                if await consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
    finally:
        await consumer.stop()
    if newest is None or newest.stopping:
        return None
    age = (datetime.now(UTC) - newest.at).total_seconds()
    return newest if age <= STALE_INTERVALS * newest.interval_s else None


def _heartbeat(value: object, group_id: str) -> ReplayerHeartbeat | None:
    """The heartbeat of `group_id`'s service in a record of the topic (anyone may write there: what does not
    decode, or is another group's, is not one)."""
    if not isinstance(value, bytes):
        return None
    try:
        beat = decode_heartbeat(value)
    except ContractError:
        return None
    return beat if beat.group_id == group_id else None


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
    clients = await _open_clients(settings, timeout_s)
    try:
        return await _ask(settings, clients, request_id, lane=lane, timeout_s=timeout_s)
    finally:
        await _close_clients(clients)


async def _open_clients(settings: ReplayerSettings, timeout_s: float) -> tuple[Any, Any]:
    """The ask's answer consumer (assigned to the ends of the answer topics) and its request producer, started
    (apart from the ask, so they start while the liveness check runs: `_live_then_ask`)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    answers = (settings.divergence_topic, settings.dead_letter_topic)
    consumer = AIOKafkaConsumer(
        **aiokafka_kwargs(settings), group_id=None, enable_auto_commit=False, fetch_max_wait_ms=FETCH_WAIT_MS
    )
    producer = AIOKafkaProducer(**aiokafka_kwargs(settings), enable_idempotence=False, linger_ms=0)
    try:
        await _with_timeout(
            "asking the replayer service", asyncio.gather(consumer.start(), producer.start()), timeout_s
        )
        partitions = [
            TopicPartition(topic, p) for topic in answers for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not partitions:
            raise ServiceReplayError(f"topics {', '.join(answers)} do not exist")
        consumer.assign(partitions)
        ends = await _with_timeout("asking the replayer service", consumer.end_offsets(partitions), timeout_s)
        for tp, offset in ends.items():
            consumer.seek(tp, offset)
    except BaseException:
        await _close_clients((consumer, producer))
        raise
    return consumer, producer


async def _discard(opened: asyncio.Future[tuple[Any, Any]]) -> None:
    """Stop clients that are no longer needed (the service is not there): cancel their start, or close them."""
    opened.cancel()
    with contextlib.suppress(BaseException):
        await _close_clients(await opened)


async def _close_clients(clients: tuple[Any, Any]) -> None:
    consumer, producer = clients
    await producer.stop()
    await consumer.stop()


async def _ask(
    settings: ReplayerSettings, clients: tuple[Any, Any], request_id: str, *, lane: str | None, timeout_s: float
) -> DivergenceEvent:
    """Send the signed request with the open `clients` and wait for the event that answers it."""
    consumer, producer = clients
    reply_to = f"cli-{uuid.uuid4().hex}"
    request = sign(ReplayRequest(request_id=request_id, lane=lane, reply_to=reply_to), settings)
    deadline = time.monotonic() + timeout_s
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


def accept(beat: ReplayerHeartbeat, event: DivergenceEvent, lane: str | None) -> str | None:
    """Why `event` is not an answer of the service of `beat` on `lane` (None: it is): the result read next is
    the one stored under the event's lane fingerprint, so that fingerprint must be one the service advertises."""
    if lane is not None and event.lane != lane:
        return f"the answer is on lane {event.lane}, not {lane}"
    if not beat.answers_with(event.lane_fingerprint_sha256):
        return (f"the answer names lane fingerprint {event.lane_fingerprint_sha256[:12]}…, which the running "
                f"service does not advertise ({beat.lane_names()})")  # fmt: skip
    return None


async def _live_then_ask(
    settings: ReplayerSettings, request_id: str, lane: str | None, timeout_s: float
) -> DivergenceEvent:
    # the liveness check and the ask's clients start together: each is a Kafka client's start-up and metadata
    opened = asyncio.ensure_future(_open_clients(settings, timeout_s))
    try:
        beat = await live_service(settings)
        if beat is None:
            raise ServiceReplayError(f"no replayer service is running (no recent heartbeat of group "
                                     f"{settings.group_id} on {settings.service_heartbeat_topic})")  # fmt: skip
        if lane is not None and lane != SCHEDULE_LANE and beat.lane != lane:
            raise ServiceReplayError(f"the running replayer service's one-at-a-time lane is {beat.lane}, not {lane}")
    except BaseException:
        await _discard(opened)
        raise
    clients = await opened
    try:
        event = await _ask(settings, clients, request_id, lane=lane, timeout_s=timeout_s)
    finally:
        await _close_clients(clients)
    refused = accept(beat, event, lane)
    if refused is not None and not beat.answers_with(event.lane_fingerprint_sha256):
        again = await live_service(settings)  # a schedule lane built for this answer is in a newer heartbeat
        refused = refused if again is None else accept(again, event, lane)
    if refused is not None:
        raise ServiceReplayError(refused)
    return event


def _run(make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """``asyncio.run(make())``, in a thread of its own when this thread already runs a loop (a command invoked
    from async code, as tests do): the coroutine is made where it runs."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def replay_via_service(
    envelope: Envelope,
    store: EnvelopeStore,
    settings: ReplayerSettings,
    via: str,
    timeout_s: float,
    say: Callable[[str], None],
    *,
    lane: str | None = None,
) -> ReplayResult | None:
    """The running service's result for `envelope` on `lane` (None: the lane it chooses, as every entry point
    does), read from S3 once it answered; None (after `say`-ing why, in one line) when ``via`` is ``auto`` and
    the service is absent or failed: the caller replays here. With ``via`` ``service`` a failure is a
    `ServiceReplayError`."""
    started = time.perf_counter()
    try:
        event = _run(lambda: _live_then_ask(settings, envelope.request_id, lane, timeout_s))
        if event.envelope_id != envelope.envelope_id():
            raise ServiceReplayError(f"the answer is about envelope {event.envelope_id[:12]}…, not this request's")
        result = store.get_result(envelope, event.lane_fingerprint_sha256)
        if result is None:
            raise ServiceReplayError(f"the replayer service answered, but result {event.result_id()} is not in S3")
    except ServiceReplayError as exc:
        if via == "service":
            raise
        reason = " ".join(str(exc).split())  # one line, whatever the service's reason held
        say(f"reprolane: not asking the replayer service ({reason}); replaying here instead, on a lane loaded "
            "here (it takes a while to load)")  # fmt: skip
        return None
    say(f"reprolane: replayed by the running replayer service on lane {event.lane} "
        f"({(time.perf_counter() - started) * 1000:.0f} ms round trip)")  # fmt: skip
    return result
