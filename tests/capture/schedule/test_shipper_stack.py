"""The schedule shipper against the real Tansu + SeaweedFS, as a user runs it (``reprolane serve schedules`` in
a subprocess), killed with SIGKILL mid-run and restarted (issue 22): every closed segment ends up in S3 exactly
once per key with the bytes the recorder wrote, its index entries beside it, on Kafka at least once, and the
directory empties; a hostile segment among them is quarantined and holds nothing back. Read back through the
index on the same S3, each request finds its own arrival, and an entry overwritten to name another's is refused."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from replayer.errors import StoreError
from replayer.schedule.store import ScheduleStore
from schemas import Envelope
from schemas.layout import (
    HEADER_ENGINE_ID,
    HEADER_SEGMENT_SEQ,
    TOPIC_SCHEDULES,
    schedule_engine_prefix,
    schedule_index_prefix,
)
from schemas.schedule_delivery import ScheduleRef, external_request_id_for
from tests import factories
from tests.capture.publishing.test_publisher_quarantine_stack import consume
from tests.schedule_segments import FakeEngine, encode, write_segment

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]

REPO = Path(__file__).resolve().parents[2]
_LAUNCH = "from infra.cli.root import app; app()"


def _start(stack: StackInfo, schedule_dir: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "REPROLANE_SCHEDULE_DIR": str(schedule_dir),
        "REPROLANE_SHIPPER_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "REPROLANE_SHIPPER_S3_ENDPOINT": stack.s3_endpoint,
        "REPROLANE_SHIPPER_S3_ACCESS_KEY": stack.s3_access_key,
        "REPROLANE_SHIPPER_S3_SECRET_KEY": stack.s3_secret_key,
        "REPROLANE_SHIPPER_S3_REGION": stack.s3_region,
        "REPROLANE_SHIPPER_S3_BUCKET": stack.audit_bucket,
        "REPROLANE_SHIPPER_POLL_S": "0.1",
    }
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, "serve", "schedules"], env=env, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip


async def _until(done: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return
        await asyncio.sleep(0.02)


def _on_disk(directory: Path) -> int:
    return sum(1 for _ in directory.glob("*/*.jsonl"))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def _segments(engine: FakeEngine, count: int, first: int) -> dict[int, bytes]:
    """`count` segments of `engine`, each with two arrivals and their steps (one still running across)."""
    out: dict[int, bytes] = {}
    for seq in range(first, first + count):
        engine.request(f"chatcmpl-rl-{engine.engine_id}-{seq}-a", output_tokens=2)
        engine.request(f"chatcmpl-rl-{engine.engine_id}-{seq}-b", output_tokens=3)
        engine.step()
        engine.step()
        out[seq] = encode(engine.take())
    return out


async def test_sigkilled_shipper_loses_nothing_and_a_hostile_segment_stalls_nothing(
    stack: StackInfo, tmp_path: Path
) -> None:
    directory, log = tmp_path / "schedules", tmp_path / "shipper.log"
    run = uuid.uuid4().hex[:8]
    engines = [FakeEngine(f"eng-{run}-{i}") for i in range(2)]
    expected: dict[tuple[str, int], bytes] = {}
    hostile = (engines[1].engine_id, 1000)
    kills: list[tuple[int, int]] = []  # (shipped, left) at each kill
    per_round = 60
    for round_no in range(3):
        for engine in engines:
            for seq, data in _segments(engine, per_round, round_no * per_round).items():
                write_segment(directory, engine.engine_id, seq, data)
                expected[engine.engine_id, seq] = data
        if round_no == 1:
            write_segment(directory, hostile[0], hostile[1], b'{"kind":"step","engine_id":"x"}\n')
        total = _on_disk(directory)
        proc = _start(stack, directory, log)
        await _until(lambda t=total, p=proc: _on_disk(directory) <= t - 15 or p.poll() is not None, 120)
        _kill(proc)  # mid-run: some shipped, some not, one possibly between S3 and Kafka
        kills.append((total - _on_disk(directory), _on_disk(directory)))
    assert all(shipped > 0 for shipped, _ in kills), (kills, log.read_text()[-3000:])
    assert any(left > 0 for _, left in kills), f"no kill landed mid-run: {kills}"

    proc = _start(stack, directory, log)
    try:
        deadline = time.monotonic() + 180
        while _on_disk(directory) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.2)
        assert _on_disk(directory) == 0, log.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    assert proc.returncode == 0, log.read_text()[-3000:]

    s3: Any = s3_client(stack.s3_endpoint, stack.s3_credentials)
    stored: dict[tuple[str, int], bytes] = {}
    for engine in engines:
        paginator = s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=stack.audit_bucket, Prefix=schedule_engine_prefix(engine.engine_id)):
            for obj in page.get("Contents", []):
                seq = int(obj["Key"].rsplit("/", 1)[1].removesuffix(".jsonl"))
                body = s3.get_object(Bucket=stack.audit_bucket, Key=obj["Key"])["Body"].read()
                stored[engine.engine_id, seq] = body
    assert stored == expected  # every segment, once per key, the recorder's bytes; the hostile one not at all

    arrivals = sum(data.count(b'"kind":"arrival"') for data in expected.values())
    index = 0
    for engine in engines:
        for page in s3.get_paginator("list_objects_v2").paginate(
            Bucket=stack.audit_bucket, Prefix=f"index/schedule/chatcmpl-rl-{engine.engine_id}-"
        ):
            index += len(page.get("Contents", []))
    assert index == arrivals

    ours = {e.engine_id for e in engines}
    records = await consume(stack, TOPIC_SCHEDULES, count=None)  # the whole topic: every copy of every segment
    seen: dict[tuple[str, int], bytes] = {}
    copies = 0
    for record in records:
        headers = dict(record.headers)
        engine_id = headers.get(HEADER_ENGINE_ID, b"").decode()
        if engine_id in ours:
            key = (engine_id, int(headers[HEADER_SEGMENT_SEQ]))
            assert seen.setdefault(key, record.value) == record.value
            copies += 1
    assert seen == expected  # at least once on Kafka, each copy the same bytes
    assert copies >= len(expected)

    quarantined = list((tmp_path / "schedules.quarantine" / hostile[0]).glob("*.reason.json"))
    assert len(quarantined) == 1
    assert "InvalidSegment" in quarantined[0].read_text()

    # read back through the index, on the real S3: each envelope its own arrival; a forged entry refused
    store = ScheduleStore(s3, stack.audit_bucket)
    a, b = (f"rl-{engines[0].engine_id}-7-{x}" for x in "ab")
    window = store.records_for(_envelope(a))
    assert [x.external_request_id for x in window.arrivals] == [f"chatcmpl-{a}"]
    assert window.complete
    (b_key,) = _index_keys(s3, stack, f"chatcmpl-{b}")
    b_entry = s3.get_object(Bucket=stack.audit_bucket, Key=b_key)["Body"].read()
    (a_key,) = _index_keys(s3, stack, f"chatcmpl-{a}")
    s3.put_object(Bucket=stack.audit_bucket, Key=a_key, Body=b_entry)  # a's entry now names b's arrival
    with pytest.raises(StoreError, match="not filed under its own ids"):
        store.records_for(_envelope(a))


def _envelope(request_id: str) -> Envelope:
    ref = ScheduleRef(external_request_id=external_request_id_for("chat.completions", request_id), recorder="t")
    return factories.envelope(request_id=request_id, schedule=ref)


def _index_keys(s3: Any, stack: StackInfo, external_id: str) -> list[str]:
    page = s3.list_objects_v2(Bucket=stack.audit_bucket, Prefix=schedule_index_prefix(external_id))
    return [o["Key"] for o in page.get("Contents", [])]
