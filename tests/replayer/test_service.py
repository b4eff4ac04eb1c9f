"""ReplayerService routing against FastStream's in-memory TestKafkaBroker and a moto S3 (fast, no stack).

The same behaviours run against real Tansu + SeaweedFS in test_service_stack.py.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from faststream.kafka import KafkaBroker, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage

from replayer.errors import ReplayerError, StoreError
from replayer.lanes.base import GenRequest
from replayer.metrics import ReplayerMetrics
from replayer.service import ReplayerService
from replayer.store import EnvelopeStore
from schemas import (
    CapturedError,
    DivergenceEvent,
    Envelope,
    ReplayedOutput,
    ReplayRequest,
    Timings,
    decode_divergence,
)
from schemas.canonical import canonical_json
from schemas.envelope_compact import encode_compact
from schemas.layout import HEADER_DLQ_REASON, HEADER_DLQ_SOURCE, HEADER_ENVELOPE_ID
from schemas.replay_auth import sign_replay_request
from tests import factories
from tests.replayer.support import (
    REPLAY_KEY_ID,
    REPLAY_SECRET,
    FakeLane,
    S3Target,
    make_envelope,
    moto_s3,
    seed_envelope,
    signed,
    write_replay_request_keys,
)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Target]:
    with moto_s3() as target:
        yield target


@dataclass
class Harness:
    service: ReplayerService
    lane: FakeLane
    events: list[DivergenceEvent] = field(default_factory=list)
    dead: list[tuple[bytes, dict[str, Any]]] = field(default_factory=list)

    @property
    def metrics(self) -> ReplayerMetrics:
        return self.service.metrics

    async def send(self, body: bytes, key: bytes = b"k") -> None:
        await self.service.broker.publish(body, self.service.settings.envelope_topic, key=key)

    async def request(self, req: ReplayRequest) -> None:
        await self.service.broker.publish(
            req.model_dump_json().encode(), self.service.settings.replay_request_topic, key=req.request_id.encode()
        )


def build(s3: S3Target, lane: FakeLane | None = None, store: EnvelopeStore | None = None, **overrides: Any) -> Harness:
    suffix = uuid.uuid4().hex[:8]
    settings = s3.settings(
        envelope_topic=f"env-{suffix}",
        divergence_topic=f"div-{suffix}",
        dead_letter_topic=f"dlq-{suffix}",
        replay_request_topic=f"req-{suffix}",
        retry_backoff_s=0.0,
        **overrides,
    )
    lane = lane or FakeLane()
    service = ReplayerService(settings, lane, store or EnvelopeStore.from_settings(settings), broker=KafkaBroker())
    h = Harness(service, lane)

    @service.broker.subscriber(settings.divergence_topic)
    async def _events(msg: KafkaMessage) -> None:
        assert msg.headers[HEADER_ENVELOPE_ID]
        h.events.append(decode_divergence(msg.body))

    @service.broker.subscriber(settings.dead_letter_topic)
    async def _dead(msg: KafkaMessage) -> None:
        h.dead.append((msg.body, dict(msg.headers)))

    return h


def greedy(n: int, lane: FakeLane, *, diverge_at: int | None = None, **overrides: Any) -> Envelope:
    env = make_envelope(n, **overrides)
    lane.learn(env, diverge_at=diverge_at)
    return env


async def test_flagged_envelope_yields_a_bitwise_event_and_a_stored_result(s3: S3Target) -> None:
    h = build(s3)
    env = greedy(1, h.lane)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical(), key=env.request_id.encode())
    assert len(h.events) == 1
    ev = h.events[0]
    assert (ev.request_id, ev.envelope_id, ev.verdict, ev.target_met) == (
        env.request_id, env.envelope_id(), "bitwise", True
    )  # fmt: skip
    stored = h.service.store.get_result(env, h.service.lane_fingerprint_sha256)
    assert stored is not None
    assert stored.event == ev
    assert h.metrics.value("reprolane_replays_total", {"lane": "fake", "verdict": "bitwise"}) == 1
    assert h.metrics.value("reprolane_replay_target_met_total", {"lane": "fake"}) == 1


async def test_perturbed_replay_diverges_and_is_counted_as_missed(s3: S3Target) -> None:
    h = build(s3)
    env = greedy(2, h.lane, diverge_at=1)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical())
    (ev,) = h.events
    assert ev.verdict == "diverged"
    assert not ev.target_met
    assert ev.first_divergence is not None
    assert ev.first_divergence.position == 1
    assert h.metrics.value("reprolane_replay_target_missed_total", {"lane": "fake"}) == 1
    assert h.metrics.value("reprolane_replay_first_divergence_position_count", {"lane": "fake"}) == 1
    assert h.metrics.value("reprolane_replay_first_divergence_position_sum", {"lane": "fake"}) == 1


async def test_unflagged_envelopes_are_skipped_unless_replay_all(s3: S3Target) -> None:
    h = build(s3)
    env = greedy(3, h.lane, flagged=False)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical())
    assert h.events == []
    assert h.lane.calls == []
    assert h.metrics.value("reprolane_replayer_not_selected_total") == 1

    h_all = build(s3, replay_all=True)
    h_all.lane.learn(env)
    async with TestKafkaBroker(h_all.service.broker):
        await h_all.send(env.canonical())
    assert [e.envelope_id for e in h_all.events] == [env.envelope_id()]


async def test_error_envelopes_are_counted_not_dead_lettered(s3: S3Target) -> None:
    h = build(s3)
    failed = make_envelope(
        4,
        outcome=CapturedError(
            error_type="timeout",
            message="upstream timed out",
            timings=Timings(received_at=factories.FIXED_TIME, upstream_ms=1.0),
        ),
    )
    async with TestKafkaBroker(h.service.broker):
        await h.send(failed.canonical())
    assert (h.events, h.dead) == ([], [])
    assert h.metrics.value("reprolane_replayer_not_replayable_total") == 1


async def test_redelivery_publishes_the_same_result_without_replaying_again(s3: S3Target) -> None:
    h = build(s3)
    env = greedy(5, h.lane)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical())
        await h.send(env.canonical())
    assert len(h.lane.calls) == 1
    assert len(h.events) == 2
    assert h.events[0].result_id() == h.events[1].result_id()
    assert h.events[0] == h.events[1]
    assert h.metrics.value("reprolane_replays_total", {"lane": "fake", "verdict": "bitwise"}) == 1
    assert h.metrics.value("reprolane_replay_deduplicated_total") == 1
    (key,) = h.service.store.list_results(env)
    assert key.endswith(f"/{h.events[0].result_id()}.json")


async def test_compact_envelopes_are_replayed_and_corrupt_or_invalid_ones_dead_lettered(s3: S3Target) -> None:
    """What the sidecar sends by default: the compact form (`schemas.envelope_compact`) of the same envelope."""
    h = build(s3)
    good = greedy(7, h.lane)
    compact = encode_compact(good.canonical())
    assert compact is not None
    bad_schema = json.loads(good.canonical())
    bad_schema["sampling"]["temperature"] = -1
    invalid = encode_compact(canonical_json(bad_schema))
    assert invalid is not None
    async with TestKafkaBroker(h.service.broker):
        await h.send(compact[:-5], key=b"poison-1")
        await h.send(invalid, key=b"poison-2")
        await h.send(compact, key=good.request_id.encode())
    assert [(e.request_id, e.envelope_id, e.verdict) for e in h.events] == [
        (good.request_id, good.envelope_id(), "bitwise")
    ]
    assert h.service.store.get_result(good, h.service.lane_fingerprint_sha256) is not None
    (body1, headers1), (_, headers2) = h.dead
    assert body1 == compact[:-5]
    assert headers1[HEADER_DLQ_REASON].startswith("undecodable: compact envelope: truncated")
    assert headers2[HEADER_DLQ_REASON].startswith("schema: ")
    assert "sampling.temperature" in headers2[HEADER_DLQ_REASON]


async def test_poison_messages_go_to_the_dead_letter_topic_and_consumption_continues(s3: S3Target) -> None:
    h = build(s3)
    good = greedy(6, h.lane)
    bad_schema = json.loads(good.canonical())
    bad_schema["sampling"]["temperature"] = -1
    async with TestKafkaBroker(h.service.broker):
        await h.send(b"\xff not json {", key=b"poison-1")
        await h.send(json.dumps(bad_schema).encode(), key=b"poison-2")
        await h.send(good.canonical())
    assert [e.request_id for e in h.events] == [good.request_id]
    assert len(h.dead) == 2
    (body1, headers1), (_, headers2) = h.dead
    assert body1 == b"\xff not json {"
    assert headers1[HEADER_DLQ_REASON].startswith("undecodable: not JSON")
    assert headers1[HEADER_DLQ_SOURCE].startswith(f"{h.service.settings.envelope_topic}/")
    assert headers2[HEADER_DLQ_REASON].startswith("schema: ")
    assert "sampling.temperature" in headers2[HEADER_DLQ_REASON]
    assert h.metrics.value("reprolane_replayer_dead_letters_total", {"reason": "undecodable"}) == 1
    assert h.metrics.value("reprolane_replayer_dead_letters_total", {"reason": "schema"}) == 1


async def test_replay_request_replays_regardless_of_selection_and_echoes_reply_to(s3: S3Target, tmp_path: Path) -> None:
    h = build(s3, replay_request_keys_path=write_replay_request_keys(tmp_path / "keys.json"))
    env = greedy(7, h.lane, flagged=False)
    seed_envelope(s3.client(), s3.bucket, env)
    async with TestKafkaBroker(h.service.broker):
        await h.request(signed(ReplayRequest(request_id=env.request_id, reply_to="ticket-42")))
        await h.request(signed(ReplayRequest(request_id=f"unknown-{uuid.uuid4().hex[:6]}", reply_to="ticket-43")))
        await h.request(signed(ReplayRequest(request_id=env.request_id, lane="transformers")))
    (ev,) = h.events
    assert (ev.request_id, ev.reply_to) == (env.request_id, "ticket-42")
    stored = h.service.store.get_result(env, h.service.lane_fingerprint_sha256)
    assert stored is not None
    assert stored.event.reply_to is None  # the stored result is the canonical one
    reasons = [headers[HEADER_DLQ_REASON] for _, headers in h.dead]
    assert reasons[0].startswith("not_found: no envelope is indexed under request id")
    assert reasons[1].startswith("wrong_lane: lane 'transformers'")


def _refusals(h: Harness) -> list[str]:
    return [headers[HEADER_DLQ_REASON] for _, headers in h.dead]


async def test_a_request_not_signed_by_a_replay_key_is_dead_lettered_as_unauthorised(
    s3: S3Target, tmp_path: Path
) -> None:
    """Whoever can write the topic cannot make the replayer replay: only a fresh request signed by a key of the
    keys file with the replay role is acted on."""
    keys = write_replay_request_keys(
        tmp_path / "keys.json",
        {
            REPLAY_KEY_ID: {"secret": REPLAY_SECRET.hex(), "roles": ["replay"]},
            "no-role": {"secret": base64.b64encode(b"r" * 32).decode(), "roles": []},
        },
    )
    h = build(s3, replay_request_keys_path=keys)
    env = greedy(5, h.lane, flagged=False)
    seed_envelope(s3.client(), s3.bucket, env)
    plain = ReplayRequest(request_id=env.request_id, reply_to="ticket-1")
    good = signed(plain)
    old = datetime.now(UTC) - timedelta(seconds=301)
    async with TestKafkaBroker(h.service.broker):
        await h.request(plain)  # unsigned
        await h.request(good.model_copy(update={"reply_to": "ticket-2"}))  # tampered after signing
        await h.request(sign_replay_request(plain, REPLAY_KEY_ID, b"w" * 32))  # wrong secret
        await h.request(sign_replay_request(plain, REPLAY_KEY_ID, REPLAY_SECRET, now=old))  # expired
        await h.request(sign_replay_request(plain, "stranger", REPLAY_SECRET))  # unknown key id
        await h.request(sign_replay_request(plain, "no-role", b"r" * 32))  # no replay role
    assert h.events == []
    assert h.lane.calls == []
    assert h.service.store.get_result(env, h.service.lane_fingerprint_sha256) is None
    reasons = _refusals(h)
    assert len(reasons) == 6
    assert all(r.startswith("unauthorised: ") for r in reasons), reasons
    assert "not signed" in reasons[0]
    assert "bad signature" in reasons[1]
    assert "bad signature" in reasons[2]
    assert "window" in reasons[3]
    assert "unknown key id 'stranger'" in reasons[4]
    assert "lacks the 'replay' role" in reasons[5]
    assert not any(REPLAY_SECRET.hex() in r for r in reasons)
    assert h.metrics.value("reprolane_replayer_dead_letters_total", {"reason": "unauthorised"}) == 6

    async with TestKafkaBroker(h.service.broker):
        await h.request(good)
    (ev,) = h.events
    assert (ev.request_id, ev.reply_to) == (env.request_id, "ticket-1")


async def test_without_a_keys_file_every_request_is_refused_unless_open(s3: S3Target) -> None:
    closed = build(s3)
    env = greedy(4, closed.lane, flagged=False)
    seed_envelope(s3.client(), s3.bucket, env)
    async with TestKafkaBroker(closed.service.broker):
        await closed.request(signed(ReplayRequest(request_id=env.request_id)))
    assert closed.events == []
    (reason,) = _refusals(closed)
    assert reason.startswith("unauthorised: no replay_request_keys_path")

    opened = build(s3, replay_requests="open")
    opened.lane.learn(env)
    async with TestKafkaBroker(opened.service.broker):
        await opened.request(ReplayRequest(request_id=env.request_id, reply_to="dev"))
    (ev,) = opened.events
    assert ev.reply_to == "dev"


@pytest.mark.parametrize(
    ("mode", "content", "match"),
    [
        (0o644, None, "readable or writable by group or others"),
        (0o600, "not json", "malformed"),
        (0o600, '{"k": {"secret": "00", "roles": ["replay"]}}', "shorter than 16 bytes"),
        (0o600, '{"k": {"secret": "' + "ab" * 16 + '", "roles": ["admin"]}}', "roles must be a list"),
        (0o600, '{"k": {"secret": "TE9DQUwtT05MWS1jaGFuZ2UtbWUtcmVwbGF5LWtleSE=", "roles": []}}', "example value"),
    ],
)
def test_a_keys_file_that_cannot_be_trusted_stops_the_replayer(
    s3: S3Target, tmp_path: Path, mode: int, content: str | None, match: str
) -> None:
    path = write_replay_request_keys(tmp_path / "keys.json")
    if content is not None:
        path.write_text(content, encoding="utf-8")
    path.chmod(mode)
    with pytest.raises(ReplayerError, match=f"replay_request_keys_path: .*{match}") as caught:
        build(s3, replay_request_keys_path=path)
    assert REPLAY_SECRET.hex() not in str(caught.value)


@dataclass
class SlowLane(FakeLane):
    active: int = 0
    peak: int = 0
    guard: threading.Lock = field(default_factory=threading.Lock)

    def replay(self, request: GenRequest) -> ReplayedOutput:
        with self.guard:
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(0.05)
        with self.guard:
            self.active -= 1
        return super().replay(request)


async def test_one_replay_at_a_time_per_process(s3: S3Target) -> None:
    lane = SlowLane()
    h = build(s3, lane=lane)
    envs = [greedy(10 + i, lane) for i in range(4)]
    async with TestKafkaBroker(h.service.broker):
        results = await asyncio.gather(*(h.service.handle_envelope_bytes(e.canonical()) for e in envs))
    assert [r.outcome for r in results] == ["replayed"] * 4
    assert lane.peak == 1


class ExplodingLane(FakeLane):
    def replay(self, request: GenRequest) -> ReplayedOutput:
        raise RuntimeError("kernel exploded")


async def test_a_lane_failure_on_one_envelope_is_dead_lettered(s3: S3Target) -> None:
    h = build(s3, lane=ExplodingLane())
    env = make_envelope(20)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical())
    assert h.events == []
    ((_, headers),) = h.dead
    assert headers[HEADER_DLQ_REASON] == "replay_failed: RuntimeError: kernel exploded"


class FlakyStore(EnvelopeStore):
    def __init__(self, inner: EnvelopeStore, failures: int) -> None:
        super().__init__(inner._client, inner.bucket)
        self.failures = failures

    def get_result(self, envelope: Envelope, lane_fingerprint_sha256: str) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise StoreError("S3 get failed: SlowDown")
        return super().get_result(envelope, lane_fingerprint_sha256)


@dataclass
class RecordingMessage:
    body: bytes
    raw_message: Any
    acked: int = 0
    nacked: int = 0

    async def ack(self) -> None:
        self.acked += 1

    async def nack(self) -> None:
        self.nacked += 1


@dataclass
class Raw:
    topic: str = "t"
    partition: int = 0
    offset: int = 7
    key: bytes = b"k"


async def test_store_errors_rewind_instead_of_committing(s3: S3Target) -> None:
    h = build(s3)
    h.service.store = FlakyStore(h.service.store, failures=1)
    env = greedy(21, h.lane)
    msg = RecordingMessage(env.canonical(), Raw())
    async with TestKafkaBroker(h.service.broker):
        await h.service._guarded(msg, h.service.handle_envelope_bytes)
        assert (msg.acked, msg.nacked, h.events) == (0, 1, [])
        assert h.metrics.value("reprolane_replayer_retries_total", {"error": "StoreError"}) == 1
        await h.service._guarded(msg, h.service.handle_envelope_bytes)  # the re-read
    assert (msg.acked, msg.nacked) == (1, 1)
    assert [e.request_id for e in h.events] == [env.request_id]


def test_metrics_are_served_on_loopback_from_their_own_registry() -> None:
    metrics = ReplayerMetrics()
    metrics.not_replayable.inc()
    server = metrics.serve(0)
    try:
        assert server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert "reprolane_replayer_not_replayable_total 1.0" in text
    assert "python_gc_objects_collected_total" not in text  # not the process-global default registry


class BuggyStore(EnvelopeStore):
    def get_result(self, envelope: Envelope, lane_fingerprint_sha256: str) -> Any:
        raise KeyError("a bug")


async def test_an_unexpected_error_is_dead_lettered_not_silently_skipped(s3: S3Target) -> None:
    h = build(s3)
    h.service.store = BuggyStore(h.service.store._client, h.service.store.bucket)
    env = greedy(22, h.lane)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical())
    ((body, headers),) = h.dead
    assert body == env.canonical()
    assert headers[HEADER_DLQ_REASON] == "internal: KeyError: 'a bug'"
    assert h.metrics.value("reprolane_replayer_dead_letters_total", {"reason": "internal"}) == 1


async def test_an_envelope_waiting_for_its_schedule_does_not_hold_the_lane(s3: S3Target) -> None:
    """The service looks for an envelope's schedule (up to ``schedule_wait_s`` while it is not shipped) before it
    takes its lane: a replay behind it, an auditor's on-demand one say, runs meanwhile."""
    from schemas.schedule_delivery import ScheduleRef, external_request_id_for

    h = build(s3)
    plain = make_envelope(41)
    ref = ScheduleRef(external_request_id=external_request_id_for(plain.endpoint, plain.request_id), recorder="r")
    waiting = plain.model_copy(update={"schedule": ref})
    h.lane.learn(waiting)
    other = greedy(42, h.lane)
    shipped = threading.Event()

    class NotShippedYet:
        """A schedule replayer whose window is still on its way (`ScheduleReplayer.find` waiting)."""

        def find(self, envelope: Envelope) -> str:
            assert shipped.wait(10)
            return "no schedule is indexed (not shipped yet)"

        def replay(self, envelope: Envelope, *, window: Any = None, **_: Any) -> Any:
            return self.find(envelope) if window is None else window  # the reason: replayed on the lane

        def lanes(self) -> tuple[str, ...]:
            return ()  # none built

    h.service.schedule = NotShippedYet()  # type: ignore[assignment]
    async with TestKafkaBroker(h.service.broker):
        first = asyncio.create_task(h.service.replay_and_publish(waiting))
        await asyncio.sleep(0.2)
        try:
            second = await asyncio.wait_for(h.service.replay_and_publish(other), 5)  # not behind the wait
            assert not first.done()
        finally:
            shipped.set()
        done = await first
    assert (done.outcome, second.outcome) == ("replayed", "replayed")
    assert {e.request_id for e in h.events} == {waiting.request_id, other.request_id}
