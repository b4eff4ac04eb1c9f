"""The replayer's schedule reader (issue 22) against moto's S3, fed by the real shipper: an envelope finds its own
engine request's records (never a neighbour's, also with ids that look alike), the window reaches back and forward
as asked, and a forged or moved index entry, a segment that is not the indexed one, or a reference to another
request is refused."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.schedule.destinations import SegmentStore
from capture.schedule.shipper import Shipper
from capture.schedule.shipper_settings import ShipperSettings
from replayer.errors import ScheduleNotFoundError, StoreError
from replayer.schedule.store import ScheduleStore
from schemas import Envelope
from schemas.layout import schedule_index_key, schedule_segment_key
from schemas.schedule import RequestArrival, ScheduleStep
from schemas.schedule_delivery import ScheduleIndexEntry, ScheduleRef, decode_index_entry, external_request_id_for
from tests import factories
from tests.capture.schedule.test_shipper import FakeProducer
from tests.moto_s3 import moto_client, moto_server
from tests.schedule_segments import FakeEngine, write_segment


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with moto_server() as endpoint:
        yield moto_client(endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"sched-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def envelope(request_id: str, endpoint: str = "chat.completions") -> Envelope:
    ref = ScheduleRef(external_request_id=external_request_id_for(endpoint, request_id), recorder="vllm-scheduler")
    return factories.envelope(request_id=request_id, endpoint=endpoint, schedule=ref)


async def _ship(s3: Any, bucket: str, tmp_path: Path, segments: list[list[Any]], engine_id: str = "eng-1") -> None:
    directory = tmp_path / f"schedules-{uuid.uuid4().hex[:6]}"
    for seq, records in enumerate(segments):
        write_segment(directory, engine_id, seq, records)
    settings = ShipperSettings(schedule_dir=directory, s3_bucket=bucket)
    shipper = Shipper(settings, store=SegmentStore(s3, bucket, retention=None), producer=FakeProducer())  # type: ignore[arg-type]
    assert await shipper.ship_pending() == len(segments)
    assert shipper.quarantined == 0


def _swapped_log() -> tuple[FakeEngine, list[list[Any]], dict[str, str]]:
    """Requests rl-a and rl-b (and rl-a1, whose id starts like rl-a's) interleaved over three segments."""
    engine = FakeEngine("eng-1")
    segments: list[list[Any]] = []
    ids = {"rl-a": engine.request("chatcmpl-rl-a", output_tokens=4)}
    engine.step()
    segments.append(engine.take())
    ids["rl-b"] = engine.request("chatcmpl-rl-b", output_tokens=2)
    ids["rl-a1"] = engine.request("chatcmpl-rl-a1", output_tokens=6)
    engine.step()
    segments.append(engine.take())
    engine.run()
    segments.append(engine.take())
    return engine, segments, ids


async def test_each_envelope_gets_its_own_engine_requests_schedule(s3: Any, bucket: str, tmp_path: Path) -> None:
    _, segments, ids = _swapped_log()
    await _ship(s3, bucket, tmp_path, segments)
    store = ScheduleStore(s3, bucket)
    for request_id, engine_rid in ids.items():
        window = store.records_for(envelope(request_id))
        assert [a.engine_request_id for a in window.arrivals] == [engine_rid]
        assert window.complete, window.gap
        assert window.engine is not None
        assert window.engine.engine_id == "eng-1"
        last = window.steps[-1]
        assert engine_rid in last.finished  # the window ends at the target's finish
        assert window.arrivals[0] in window.records
        assert window.records[0].step == window.arrivals[0].step  # it starts at the arrival (before_steps=0)
    b = store.records_for(envelope("rl-b"))
    a1 = store.records_for(envelope("rl-a1"))
    assert len(b.steps) < len(a1.steps)


async def test_the_window_reaches_back_before_the_arrival(s3: Any, bucket: str, tmp_path: Path) -> None:
    _, segments, ids = _swapped_log()
    await _ship(s3, bucket, tmp_path, segments)
    window = ScheduleStore(s3, bucket).records_for(envelope("rl-b"), before_steps=5)
    assert window.first_segment == 0
    assert window.complete
    kinds = [(type(r).__name__, getattr(r, "engine_request_id", None)) for r in window.records]
    assert kinds[0] == ("RequestArrival", ids["rl-a"])  # the companion already running when rl-b arrived
    assert any(isinstance(r, ScheduleStep) and r.step == 0 for r in window.records)


async def test_a_log_that_does_not_reach_the_finish_says_so(s3: Any, bucket: str, tmp_path: Path) -> None:
    _, segments, _ = _swapped_log()
    await _ship(s3, bucket, tmp_path, segments[:2])
    window = ScheduleStore(s3, bucket).records_for(envelope("rl-a1"))
    assert not window.complete
    assert window.gap is not None
    assert "before the request finished" in window.gap
    s3.delete_object(Bucket=bucket, Key=schedule_segment_key("eng-1", 0))
    window = ScheduleStore(s3, bucket).records_for(envelope("rl-b"), before_steps=10)
    assert not window.complete
    assert window.engine is None


async def test_no_schedule(s3: Any, bucket: str) -> None:
    store = ScheduleStore(s3, bucket)
    with pytest.raises(ScheduleNotFoundError, match="names no schedule"):
        store.records_for(factories.envelope())
    with pytest.raises(ScheduleNotFoundError, match="no schedule is indexed"):
        store.records_for(envelope("rl-never"))


async def test_a_reference_to_another_request_is_refused(s3: Any, bucket: str, tmp_path: Path) -> None:
    _, segments, _ = _swapped_log()
    await _ship(s3, bucket, tmp_path, segments)
    forged = factories.envelope(
        request_id="rl-a", schedule=ScheduleRef(external_request_id="chatcmpl-rl-b", recorder="vllm-scheduler")
    )
    with pytest.raises(StoreError, match="not its own engine request"):
        ScheduleStore(s3, bucket).records_for(forged)


def _entry(s3: Any, bucket: str, request_id: str, engine_rid: str) -> ScheduleIndexEntry:
    key = schedule_index_key(f"chatcmpl-{request_id}", engine_rid)
    return decode_index_entry(s3.get_object(Bucket=bucket, Key=key)["Body"].read())


async def test_forged_index_entries_are_refused(s3: Any, bucket: str, tmp_path: Path) -> None:
    """Entries an attacker with write access to the index prefix could add: each is caught on read."""
    _, segments, ids = _swapped_log()
    await _ship(s3, bucket, tmp_path, segments)
    store = ScheduleStore(s3, bucket)
    b = _entry(s3, bucket, "rl-b", ids["rl-b"])
    a = _entry(s3, bucket, "rl-a", ids["rl-a"])

    def forge(request_id: str, name: str, body: bytes) -> None:
        s3.put_object(Bucket=bucket, Key=schedule_index_key(f"chatcmpl-{request_id}", name), Body=body)

    # rl-b's entry copied under rl-a's id: filed under ids that are not its own
    forge("rl-a", ids["rl-b"], b.encode())
    with pytest.raises(StoreError, match="not filed under its own ids"):
        store.records_for(envelope("rl-a"))
    s3.delete_object(Bucket=bucket, Key=schedule_index_key("chatcmpl-rl-a", ids["rl-b"]))
    assert store.records_for(envelope("rl-a")).complete

    # an entry that claims rl-b's arrival is rl-a's: the segment holds no such arrival
    moved = a.model_copy(update={"engine_request_id": ids["rl-b"], "segment": b.segment, "step": b.step})
    moved = moved.model_copy(update={"segment_sha256": b.segment_sha256})
    forge("rl-a", ids["rl-b"], moved.encode())
    with pytest.raises(StoreError, match="holds no arrival"):
        store.records_for(envelope("rl-a"))
    s3.delete_object(Bucket=bucket, Key=schedule_index_key("chatcmpl-rl-a", ids["rl-b"]))

    # a second engine request under rl-a on another engine
    forge("rl-a", "chatcmpl-rl-a-ffffffff", a.model_copy(update={"engine_id": "eng-2",
          "engine_request_id": "chatcmpl-rl-a-ffffffff"}).encode())  # fmt: skip
    with pytest.raises(StoreError, match="several engines"):
        store.records_for(envelope("rl-a"))
    s3.delete_object(Bucket=bucket, Key=schedule_index_key("chatcmpl-rl-a", "chatcmpl-rl-a-ffffffff"))

    # the entry is fine but the segment it names was replaced (the entry's sha256 no longer holds): a store that
    # reads it now refuses it (one that checked the segment before keeps the bytes it checked: test_segment_cache)
    s3.put_object(Bucket=bucket, Key=schedule_segment_key("eng-1", b.segment), Body=b"\n")
    with pytest.raises(StoreError, match="sha256"):
        ScheduleStore(s3, bucket).records_for(envelope("rl-b"))

    # garbage and oversized entries
    forge("rl-x", "chatcmpl-rl-x-0", b"{not json")
    with pytest.raises(StoreError, match="malformed"):
        store.records_for(envelope("rl-x"))
    forge("rl-y", "chatcmpl-rl-y-0", b" " * 10_000)
    with pytest.raises(StoreError, match="over"):
        store.records_for(envelope("rl-y"))


async def test_completions_and_children_of_n(s3: Any, bucket: str, tmp_path: Path) -> None:
    """A completions request's first prompt is ``cmpl-<id>-0``; ``n > 1`` has one arrival per child."""
    engine = FakeEngine("eng-9")
    children = [engine.request("cmpl-rl-c-0", output_tokens=2 + i) for i in range(3)]
    engine.request("cmpl-rl-c-1")  # the request's second prompt: another external id
    engine.run()
    await _ship(s3, bucket, tmp_path, [engine.take()], engine_id="eng-9")
    window = ScheduleStore(s3, bucket).records_for(envelope("rl-c", "completions"))
    assert sorted(a.engine_request_id for a in window.arrivals) == sorted(children)
    assert window.complete
    assert all(isinstance(a, RequestArrival) for a in window.arrivals)


async def test_an_arrival_before_a_segment_boundary_is_in_the_window(s3: Any, bucket: str, tmp_path: Path) -> None:
    """The recorder writes an arrival before the step that first schedules it; a segment may close in between:
    the companion's arrival is then in the segment before its first step, and the window must hold it."""
    engine = FakeEngine("eng-1")
    companion = engine.request(external_request_id_for("chat.completions", "rl-x"), output_tokens=4)
    first = engine.take()  # the engine start and the companion's arrival
    engine.step()  # step 0: the companion alone
    target = engine.request(external_request_id_for("chat.completions", "rl-a"))
    engine.run()
    await _ship(s3, bucket, tmp_path, [first, engine.take()])
    window = ScheduleStore(s3, bucket).records_for(envelope("rl-a"), before_steps=1 << 40)
    assert window.complete
    assert [a.engine_request_id for a in window.arrivals] == [target]
    arrivals = [r.engine_request_id for r in window.records if isinstance(r, RequestArrival)]
    assert arrivals == [companion, target]
    assert window.first_segment == 0


async def test_segment_cache(s3: Any, bucket: str, tmp_path: Path) -> None:
    """Every window reads its engine's log from the first segment: a store reads each shipped segment once, keeps
    the checked records within its byte budget, and answers them even if the object is replaced later."""
    _, segments, _ = _swapped_log()
    await _ship(s3, bucket, tmp_path, segments)
    store = ScheduleStore(s3, bucket)
    first = store.records_for(envelope("rl-b"), before_steps=1 << 40)
    read = store.segments_read
    assert read >= 2
    again = store.records_for(envelope("rl-b"), before_steps=1 << 40)
    assert again == first
    assert store.segments_read == read  # nothing read twice
    for seq in range(first.first_segment, first.last_segment + 1):
        s3.put_object(Bucket=bucket, Key=schedule_segment_key("eng-1", seq), Body=b"\n")
    assert store.records_for(envelope("rl-b"), before_steps=1 << 40) == first  # the bytes it checked
    small = ScheduleStore(s3, bucket, cache_bytes=0)
    with pytest.raises(StoreError):
        small.records_for(envelope("rl-b"), before_steps=1 << 40)
