"""How a long-running consumer (the archiver, the replayer service) learns to stop: SIGINT or SIGTERM sets an
event its loop waits on, so the message in hand is finished and the consumer's offsets are committed before
the process exits, instead of dying mid-batch on the default handler's KeyboardInterrupt.

Beside the clients because both services, which may not import each other, run their clients this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, in the running loop (call it inside the loop). Where the loop cannot
    take signal handlers (not the main thread, or a platform without them) only the caller sets it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop
