"""What a schedule replay reads of an engine's log (`replayer.schedule.window`), against moto's S3 fed by the real
shipper: the target's busy period and the periods of its prefix-cache providers, found through their own index
entries, and not the periods in between, however many; a period that starts segments before the target's arrival
is read back to its start; a provider that is not indexed is left out; the read budget holds."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from replayer.errors import StoreError
from replayer.schedule.plan import plan_replay
from replayer.schedule.replay import window_log
from replayer.schedule.store import ScheduleStore
from replayer.schedule.window import read_window
from schemas.layout import schedule_index_key
from schemas.schedule_delivery import decode_index_entry, external_request_id_for
from schemas.schedule_log import ScheduleLog
from tests.moto_s3 import moto_client, moto_server
from tests.replayer.schedule.test_store import _ship, envelope
from tests.schedule_segments import FakeEngine


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with moto_server() as endpoint:
        yield moto_client(endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"window-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def chat(request_id: str) -> str:
    return external_request_id_for("chat.completions", request_id)


def long_running(unrelated: int) -> tuple[list[list[Any]], dict[str, str]]:
    """A provider's period (segment 0), ``unrelated`` periods (a segment each), then the target and a companion
    whose arrivals read the provider's first block (the last segment)."""
    engine = FakeEngine("eng-1")
    ids = {"p": engine.request(chat("rl-p"), prompt_tokens=32)}
    engine.run()
    segments = [engine.take()]
    for i in range(unrelated):
        engine.request(chat(f"rl-x{i}"))
        engine.run()
        segments.append(engine.take())
    ids["t"] = engine.request(chat("rl-t"), prompt_tokens=40, cached_from=((ids["p"], 1),))
    ids["c"] = engine.request(chat("rl-c"), prompt_tokens=24, cached_from=((ids["p"], 1),))
    engine.run()
    segments.append(engine.take())
    return segments, ids


async def test_the_window_is_the_targets_period_and_its_providers_not_the_periods_between(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    segments, ids = long_running(40)
    await _ship(s3, bucket, tmp_path, segments)
    store = ScheduleStore(s3, bucket)
    window = read_window(store, envelope("rl-t"))
    assert window.complete, window.gap
    assert window.ranges == ((0, 2), (123, 125))  # p ran steps 0-2, each unrelated period 3 steps
    # segment 0 (engine, provider), the target's, and the two next to them that show where each period ends and
    # starts: not the other 38 between
    assert store.segments_read == 4
    log = window_log(window)
    assert log.problems() == []
    plan = plan_replay(log, ids["t"])
    assert plan.periods == window.ranges
    assert plan.notes == []
    assert sorted(p.arrival.engine_request_id for p in plan.requests) == sorted(ids.values())


async def test_a_provider_that_is_not_indexed_is_left_out_and_noted(s3: Any, bucket: str, tmp_path: Path) -> None:
    segments, ids = long_running(3)
    await _ship(s3, bucket, tmp_path, segments)
    s3.delete_object(Bucket=bucket, Key=schedule_index_key(chat("rl-p"), ids["p"]))  # e.g. its id was cut
    window = read_window(ScheduleStore(s3, bucket), envelope("rl-t"))
    assert window.complete
    assert window.ranges == ((12, 14),)
    plan = plan_replay(window_log(window), ids["t"])
    assert any("outside the log" in n for n in plan.notes)


def spread_period() -> tuple[list[list[Any]], dict[str, str]]:
    """One busy period over five segments: a long request starts in segment 0, the target arrives in segment 3."""
    engine = FakeEngine("eng-1")
    ids = {"long": engine.request(chat("rl-long"), output_tokens=12)}
    segments = []
    for _ in range(3):
        engine.step()
        engine.step()
        segments.append(engine.take())
    ids["t"] = engine.request(chat("rl-t"))
    engine.step()
    segments.append(engine.take())
    engine.run()
    segments.append(engine.take())
    return segments, ids


async def test_a_period_that_started_segments_earlier_is_read_back_to_its_start(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    segments, ids = spread_period()
    await _ship(s3, bucket, tmp_path, segments)
    window = read_window(ScheduleStore(s3, bucket), envelope("rl-t"))
    assert window.complete, window.gap
    assert window.ranges is not None
    assert window.ranges[0][0] == 0  # the long request's first step, three segments before the target's arrival
    plan = plan_replay(window_log(window), ids["t"])
    assert [p.arrival.engine_request_id for p in plan.requests] == [ids["long"], ids["t"]]
    small = ScheduleStore(s3, bucket)
    small.max_segments = 2
    cut = read_window(small, envelope("rl-t"))
    assert not cut.complete
    assert cut.gap is not None
    assert "over 2 segments" in cut.gap


async def test_a_provider_entry_on_another_engine_is_refused(s3: Any, bucket: str, tmp_path: Path) -> None:
    segments, ids = long_running(2)
    await _ship(s3, bucket, tmp_path, segments)
    key = schedule_index_key(chat("rl-p"), ids["p"])
    entry = decode_index_entry(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    s3.put_object(Bucket=bucket, Key=key, Body=entry.model_copy(update={"engine_id": "eng-2"}).encode())
    with pytest.raises(StoreError, match="names engine eng-2"):
        read_window(ScheduleStore(s3, bucket), envelope("rl-t"))


async def test_an_arrival_whose_segment_closed_before_its_first_step(s3: Any, bucket: str, tmp_path: Path) -> None:
    """The engine's first request: segment 0 holds the engine start, segment 1 only the arrival (the recorder
    closed it before the step that scheduled it), the steps follow in segment 2."""
    engine = FakeEngine("eng-1")
    segments = [engine.take()]
    target = engine.request(chat("rl-t"))
    segments.append(engine.take())
    engine.run()
    segments.append(engine.take())
    await _ship(s3, bucket, tmp_path, segments)
    window = read_window(ScheduleStore(s3, bucket), envelope("rl-t"))
    assert window.complete, window.gap
    assert window.ranges == ((0, 2),)
    assert [p.arrival.engine_request_id for p in plan_replay(window_log(window), target).requests] == [target]


async def test_a_long_providers_period_is_read_ahead_not_rebuilt_per_segment(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider whose busy period spans 60 segments: its end is found by reading ahead, so the stretch is
    rebuilt and checked a logarithmic number of times, and at most half as many segments again are read."""
    engine = FakeEngine("eng-1")
    ids = {"p": engine.request(chat("rl-p"), prompt_tokens=32, output_tokens=120)}
    segments = []
    for _ in range(60):  # two steps of p per segment
        engine.step()
        engine.step()
        segments.append(engine.take())
    engine.run()
    segments.append(engine.take())
    ids["t"] = engine.request(chat("rl-t"), prompt_tokens=40, cached_from=((ids["p"], 1),))
    engine.run()
    segments.append(engine.take())
    await _ship(s3, bucket, tmp_path, segments)
    builds = 0
    real = ScheduleLog.from_records.__func__  # type: ignore[attr-defined]

    def counted(cls: type[ScheduleLog], records: Any, **kw: Any) -> ScheduleLog:
        nonlocal builds
        builds += 1
        return real(cls, records, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(ScheduleLog, "from_records", classmethod(counted))
    store = ScheduleStore(s3, bucket)
    window = read_window(store, envelope("rl-t"))
    monkeypatch.undo()
    assert window.complete, window.gap
    assert window.ranges is not None
    assert window.ranges[0][0] == 0
    assert len(window.ranges) == 2
    assert plan_replay(window_log(window), ids["t"]).notes == []
    assert builds < 25  # one per segment read forwards was over 60
    assert store.segments_read <= len(segments)
