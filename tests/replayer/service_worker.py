"""A replayer service in a process of its own, for the crash tests: ``python -m tests.replayer.service_worker``.

Settings come from ``REPROLANE_REPLAYER_*``. The lane is `ArithmeticLane` (deterministic across processes).
With ``REPROLANE_TEST_HANG_ON=<request id>`` the process that stores that request's result writes
``REPROLANE_TEST_MARKER`` and then hangs before publishing or committing, so the test can SIGKILL it there (a
process that finds the result already stored, the redelivery, does not hang). With ``REPROLANE_TEST_JOURNAL``
every replay the metrics count is appended there as its request id, one line each, so a test can add up what
several processes counted, the killed one included. Warnings (retries, failed commits) go to stderr.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from infra.clients.s3 import S3Policy, make_s3_client
from replayer.metrics import ReplayerMetrics
from replayer.service import ReplayerService, run_until_signalled
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import DivergenceEvent, Envelope, ReplayResult
from tests.replayer.support import ArithmeticLane


class HangingStore(EnvelopeStore):
    def __init__(self, settings: ReplayerSettings, hang_on: str | None, marker: Path | None) -> None:
        super().__init__(make_s3_client(settings, policy=S3Policy.REPLAYER), settings.s3_bucket)
        self.hang_on = hang_on
        self.marker = marker

    def put_result(self, envelope: Envelope, result: ReplayResult) -> bool:
        written = super().put_result(envelope, result)
        if written and envelope.request_id == self.hang_on and self.marker is not None:
            self.marker.write_text(result.event.result_id())
            time.sleep(3600)  # killed here: stored, not published, not committed
        return written


class JournalMetrics(ReplayerMetrics):
    """The service's metrics, each counted replay also appended to a file (survives a SIGKILL: no buffer)."""

    def __init__(self, journal: Path | None) -> None:
        super().__init__()
        self.journal = journal

    def observe_replay(self, event: DivergenceEvent, seconds: float, runtime_sha256: str = "") -> None:
        super().observe_replay(event, seconds, runtime_sha256)
        if self.journal is not None:
            fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, f"{event.request_id}\n".encode())
            finally:
                os.close(fd)


def _path(variable: str) -> Path | None:
    value = os.environ.get(variable)
    return Path(value) if value else None


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = ReplayerSettings()
    store = HangingStore(settings, os.environ.get("REPROLANE_TEST_HANG_ON"), _path("REPROLANE_TEST_MARKER"))
    metrics = JournalMetrics(_path("REPROLANE_TEST_JOURNAL"))
    asyncio.run(run_until_signalled(ReplayerService(settings, ArithmeticLane(), store, metrics)))


if __name__ == "__main__":
    main()
