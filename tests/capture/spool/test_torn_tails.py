"""After a power loss or a kill -9 the spool keeps every complete record: a torn tail is cut at the last
complete record, wherever in the record the write stopped (issue #18, finding 6)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from capture.spool import Spool
from capture.spool.disk_format import HEADER_SIZE, RECORD_HEADER

REPO = Path(__file__).resolve().parents[3]


async def read_back(directory: Path) -> list[bytes]:
    spool = Spool(directory, max_bytes=1 << 30)
    await spool.open()
    try:
        return [e.payload for e in await spool.pending(1_000_000)]
    finally:
        await spool.close()


async def test_a_segment_cut_at_every_byte_of_its_last_record_keeps_every_complete_record(tmp_path: Path) -> None:
    source = tmp_path / "source"
    records = [b'{"n":%d,"pad":"%s"}' % (i, b"p" * (10 * i)) for i in range(4)]
    spool = Spool(source, max_bytes=1 << 24)
    await spool.open()
    for record in records:
        await spool.append_payload(record)
    await spool.close()
    (segment,) = sorted(source.glob("*.seg"))
    data = segment.read_bytes()
    last_start = len(data) - RECORD_HEADER.size - len(records[-1])
    assert last_start > HEADER_SIZE
    for cut in range(last_start, len(data)):  # every length the last record can have been cut to, but whole
        case = tmp_path / f"cut-{cut}"
        shutil.copytree(source, case)
        with (case / segment.name).open("r+b") as fh:
            fh.truncate(cut)
        assert await read_back(case) == records[:-1], cut
        spool = Spool(case, max_bytes=1 << 24)  # and it goes on: the next record follows the last complete one
        await spool.open()
        await spool.append_payload(b'{"after":1}')
        await spool.close()
        assert await read_back(case) == [*records[:-1], b'{"after":1}'], cut
        shutil.rmtree(case)


async def test_a_segment_cut_inside_its_header_opens_empty(tmp_path: Path) -> None:
    """A crash while a new segment was being created (a roll, or the first open)."""
    source = tmp_path / "source"
    spool = Spool(source, max_bytes=1 << 24)
    await spool.open()
    await spool.close()
    (segment,) = sorted(source.glob("*.seg"))
    for cut in range(HEADER_SIZE):
        case = tmp_path / f"cut-{cut}"
        shutil.copytree(source, case)
        with (case / segment.name).open("r+b") as fh:
            fh.truncate(cut)
        assert await read_back(case) == []
        shutil.rmtree(case)


def _run_and_kill(directory: Path, prefix: str, after: int) -> set[str]:
    """Start the append worker, SIGKILL it once it has reported `after` appends; the ids it reported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.capture.spool.append_worker", str(directory), prefix],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert proc.stdout is not None
    acknowledged: set[str] = set()
    try:
        for line in proc.stdout:
            if line.startswith("appended "):
                acknowledged.add(line.split()[1])
                if len(acknowledged) >= after:
                    break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert len(acknowledged) >= after, "the worker stopped before the kill"
    return acknowledged


async def test_kill_9_during_appends_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """Three runs on one spool, each killed mid-append: every record an append returned for is there after the
    restart, each once, intact, and every record found is one the workers wrote."""
    directory = tmp_path / "spool"
    acknowledged: set[str] = set()
    for run, after in enumerate((400, 150, 700)):
        acknowledged |= _run_and_kill(directory, f"run{run}", after)
        found = [json.loads(payload)["id"] for payload in await read_back(directory)]
        assert len(found) == len(set(found))
        assert acknowledged <= set(found), sorted(acknowledged - set(found))[:5]
        assert all(rid.startswith(tuple(f"run{r}-" for r in range(run + 1))) for rid in found)
    assert len(list(directory.glob("*.seg"))) > 2  # the runs rolled segments
