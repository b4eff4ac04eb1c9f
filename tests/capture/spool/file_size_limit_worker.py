"""A spool on a "disk" the kernel fills: ``RLIMIT_FSIZE`` makes writes past the limit short, then ``EFBIG``
(the same as a full disk: what fits is written, the rest refused), for tests/capture/spool/test_disk_full.py.

    python -m tests.capture.spool.file_size_limit_worker SPOOL_DIR LIMIT_BYTES

Appends records until the spool refuses one (printing ``appended N`` for each append that returned), then
``refused N``, lifts the limit (space is back), appends three more and prints ``resumed`` and exits.
"""

from __future__ import annotations

import asyncio
import resource
import signal
import sys
from pathlib import Path

from capture.errors import SpoolFullError
from capture.spool import Spool


def record(n: int) -> bytes:
    return b'{"n":%d,"pad":"%s"}' % (n, b"z" * (700 + n % 300))


async def main(directory: Path, limit: int) -> None:
    spool = Spool(directory, max_bytes=1 << 30, segment_bytes=1 << 30)
    await spool.open()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    n = 0
    while True:
        try:
            await spool.append_payload(record(n))
        except SpoolFullError:
            print(f"refused {n}", flush=True)
            break
        print(f"appended {n}", flush=True)
        n += 1
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    for m in range(n + 1, n + 4):
        await spool.append_payload(record(m))
        print(f"appended {m}", flush=True)
    print("resumed", flush=True)
    await spool.close()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))
