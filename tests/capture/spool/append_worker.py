"""A process that appends to a spool in a loop until it is killed, for the SIGKILL test of the spool alone
(tests/capture/spool/test_torn_tails.py; tests/capture/spool_worker.py is the one that also publishes).

    python -m tests.capture.spool.append_worker SPOOL_DIR PREFIX

Eight tasks append records ``{"id": "PREFIX-T-N", ...}`` of varying sizes (so batches share group commits and
segments roll), and each prints ``appended PREFIX-T-N`` once its `Spool.append_payload` has returned.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from capture.spool import Spool


async def appender(spool: Spool, prefix: str, task: int) -> None:
    n = 0
    while True:
        rid = f"{prefix}-{task}-{n}"
        payload = json.dumps({"id": rid, "pad": "x" * ((n * 37 + task * 101) % 3000)}).encode()
        await spool.append_payload(payload)
        sys.stdout.write(f"appended {rid}\n")
        sys.stdout.flush()
        n += 1


async def main(directory: Path, prefix: str) -> None:
    spool = Spool(directory, max_bytes=1 << 30, segment_bytes=64 * 1024)
    await spool.open()
    print(f"recovered {spool.depth}", flush=True)
    await asyncio.gather(*(appender(spool, prefix, t) for t in range(8)))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
