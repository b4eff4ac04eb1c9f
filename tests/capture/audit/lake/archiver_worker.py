"""An archiver process that SIGKILLs itself at the worst moment: right after its Nth flush wrote rows to the lake,
before their offsets are committed (``REPROLANE_TEST_KILL_AFTER_FLUSH=N``; settings from ``REPROLANE_ARCHIVER_*``
as `reprolane serve archiver` reads them). Used by test_archiver_faults_stack.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from capture.audit.lake.archiver import Archiver, run_until_signalled
from capture.audit.lake.cli import open_lake
from capture.audit.lake.settings import LakeSettings


class KilledAfterFlush(Archiver):
    kill_after = int(os.environ.get("REPROLANE_TEST_KILL_AFTER_FLUSH", "0"))

    async def flush(self) -> list[str]:
        paths = await super().flush()
        if paths and self.stats.flushes == self.kill_after:
            logging.getLogger("reprolane.archiver").warning("test worker: SIGKILL after flush %d", self.stats.flushes)
            os.kill(os.getpid(), signal.SIGKILL)
        return paths


def main() -> None:
    settings = LakeSettings()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(run_until_signalled(KilledAfterFlush(settings, open_lake(settings))))


if __name__ == "__main__":
    main()
