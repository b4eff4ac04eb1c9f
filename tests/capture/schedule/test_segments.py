"""The schedule recorder's segment writer: complete segments only after fsync + rename, canonical lines,
rotation by size and time, and IO errors counted instead of raised (the engine must keep serving)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

from capture.schedule.segments import SegmentWriter
from schemas.schedule import ScheduledRequest, ScheduleStep
from schemas.schedule_delivery import decode_segment, encode_record

AT = datetime(2026, 12, 1, 12, 0, 0, 123456, tzinfo=UTC)


def step_dict(n: int) -> dict[str, object]:
    return {
        "kind": "step",
        "engine_id": "e1",
        "step": n,
        "at": "2026-12-01T12:00:00.123456Z",
        "scheduled": [{"engine_request_id": "r-1", "num_computed_tokens": n, "num_scheduled_tokens": 1}],
        "finished": [],
        "preempted": [],
    }


def step_model(n: int) -> ScheduleStep:
    return ScheduleStep(
        engine_id="e1",
        step=n,
        at=AT,
        scheduled=(ScheduledRequest(engine_request_id="r-1", num_computed_tokens=n, num_scheduled_tokens=1),),
    )


def test_the_writers_line_is_the_records_canonical_json(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "e1", rotate_seconds=60)
    w.submit(step_dict(3))
    assert w.sync()
    w.close()
    assert (tmp_path / "e1" / "00000000.jsonl").read_bytes() == encode_record(step_model(3))


def test_a_segment_is_a_part_until_it_rotates(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "e1", rotate_seconds=60)
    w.submit(step_dict(0))
    deadline = time.monotonic() + 5
    while w.records == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    names = sorted(p.name for p in (tmp_path / "e1").iterdir())
    assert names == ["00000000.jsonl.part"]
    w.close()
    assert sorted(p.name for p in (tmp_path / "e1").iterdir()) == ["00000000.jsonl"]
    assert w.segments_completed == 1


def test_rotation_by_size_and_on_time_while_idle(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "e1", rotate_seconds=0.2, rotate_bytes=300)
    for n in range(6):
        w.submit(step_dict(n))
    deadline = time.monotonic() + 5
    while w.segments_completed < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    w.close()
    segs = sorted((tmp_path / "e1").glob("*.jsonl"))
    assert len(segs) >= 2
    steps = [r.step for p in segs for r in decode_segment(p.read_bytes(), "e1") if isinstance(r, ScheduleStep)]
    assert steps == list(range(6))


def test_an_io_error_is_counted_not_raised(tmp_path: Path) -> None:
    (tmp_path / "e1").write_text("a file where the engine's directory should be")
    w = SegmentWriter(tmp_path, "e1", rotate_seconds=60)
    w.submit(step_dict(0))
    w.sync()
    w.close()
    assert w.io_errors >= 1
    assert w.records == 0


def test_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    w = SegmentWriter(tmp_path, "e1", rotate_seconds=60, max_queue=0)
    w.submit(step_dict(0))
    w.close()
    assert w.dropped == 1
