"""A replayer service in a process of its own, for the crash test: ``python -m tests.replayer.service_worker``.

Settings come from ``REPROLANE_REPLAYER_*``. The lane is `ArithmeticLane` (deterministic across processes). With
``REPROLANE_TEST_HANG_ON=<request id>`` the process stores that request's result, writes
``REPROLANE_TEST_MARKER``, and then hangs before publishing or committing, so the test can SIGKILL it there.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from infra.clients.s3 import S3Policy, make_s3_client
from replayer.service import ReplayerService, run_until_signalled
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayResult
from tests.replayer.support import ArithmeticLane


class HangingStore(EnvelopeStore):
    def __init__(self, settings: ReplayerSettings, hang_on: str | None, marker: Path | None) -> None:
        super().__init__(make_s3_client(settings, policy=S3Policy.REPLAYER), settings.s3_bucket)
        self.hang_on = hang_on
        self.marker = marker

    def put_result(self, envelope: Envelope, result: ReplayResult) -> bool:
        written = super().put_result(envelope, result)
        if envelope.request_id == self.hang_on and self.marker is not None:
            self.marker.write_text(result.event.result_id())
            time.sleep(3600)  # killed here: stored, not published, not committed
        return written


def main() -> None:
    settings = ReplayerSettings()
    marker = os.environ.get("REPROLANE_TEST_MARKER")
    store = HangingStore(settings, os.environ.get("REPROLANE_TEST_HANG_ON"), Path(marker) if marker else None)
    asyncio.run(run_until_signalled(ReplayerService(settings, ArithmeticLane(), store)))


if __name__ == "__main__":
    main()
