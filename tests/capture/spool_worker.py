"""A sidecar's durability half in its own process, for the SIGKILL test
(tests/capture/publishing/test_durability_stack.py).

    python -m tests.capture.spool_worker SPOOL_DIR TOPIC PREFIX COUNT

Settings come from the environment (``REPROLANE_CAPTURE_*``: Kafka bootstrap, S3 endpoint and credentials).
Appends COUNT envelopes (request ids ``PREFIX-00000``...) one after another, printing ``appended <envelope_id>``
as soon as each `Spool.append` has returned, while a `Publisher` drains to Kafka (TOPIC) and S3; then keeps
publishing until killed. COUNT 0 only publishes what the spool holds (the restart after the kill).
"""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path

from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from tests.factories import envelope


async def main(spool_dir: Path, topic: str, prefix: str, count: int) -> None:
    settings = CaptureSettings(upstream="http://127.0.0.1:9", spool_dir=spool_dir)
    spool = Spool(spool_dir, max_bytes=settings.spool_max_bytes, group_commit_ms=settings.group_commit_ms)
    await spool.open()
    print(f"recovered {spool.depth}", flush=True)
    publisher = Publisher(spool, settings, sinks=[KafkaSink(settings, topic=topic), S3Sink(settings)])
    await publisher.start()
    for i in range(count):
        env = envelope(request_id=f"{prefix}-{i:05d}", tenant=prefix, captured_at=datetime.now(UTC))
        await spool.append(env)
        print(f"appended {env.envelope_id()}", flush=True)
        await asyncio.sleep(0.005)
    print("appends done", flush=True)
    while True:
        await asyncio.sleep(0.2)
        if spool.depth == 0:
            print("drained", flush=True)


if __name__ == "__main__":
    directory, topic_name, request_prefix, how_many = sys.argv[1:5]
    asyncio.run(main(Path(directory), topic_name, request_prefix, int(how_many)))
