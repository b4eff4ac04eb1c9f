"""Shared fixtures. The ``stack`` fixture owns the real local stack for a whole test session.

Started once (about a minute, most of it vLLM) and stopped at the end; every test that needs it gets
the same :class:`~infra.stack.state.StackInfo`. Tests must isolate themselves inside it (a uuid topic, a
uuid object key), never by restarting it, except the few stack tests that exercise restarts.

Set ``REPROLANE_TEST_RUN_DIR`` to attach to a stack you keep running (``reprolane stack up --run-dir``):
the fixture then only makes sure it is up and never takes it down. On a 2-core machine this avoids one vLLM
per pytest run. No test takes the session's stack down: ``down()`` is tested on a private stack, and the
fixture itself checks at the end that ``down()`` left no process group of the session's stack alive.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import process
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo, StackState

# Tests that are not about authentication run the sidecar without it (`capture.request.auth`); those that are set
# auth_mode and a key file explicitly. Set before any CaptureSettings is built; subprocesses inherit it.
os.environ.setdefault("REPROLANE_CAPTURE_AUTH_MODE", "off")

#: Run dir of an already running stack to reuse instead of starting a private one.
ATTACH_ENV = "REPROLANE_TEST_RUN_DIR"


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The session's :class:`LocalStack`, up (S3, Kafka on S3 storage, vLLM CPU), down at the end."""
    attached = os.environ.get(ATTACH_ENV)
    run_dir: Path = Path(attached) if attached else tmp_path_factory.mktemp("stack")
    stack = LocalStack(run_dir)
    try:
        stack.up()
        yield stack
    finally:
        if not attached:
            _down_and_check(stack)


def _down_and_check(stack: LocalStack) -> None:
    """Stop the session's stack and fail the session if any of its process groups survived (vLLM's engine
    core is a child process: the group, not the pid, must be gone)."""
    try:
        refs = [rec.process for rec in StackState.load(stack.run_dir).servers.values()]
    except Exception:  # no state file: nothing was started
        refs = []
    stack.down()
    survivors = [ref.pid for ref in refs if ref is not None and process.group_alive(ref.pid)]
    assert not survivors, f"stack down left process groups alive: {survivors}"


@pytest.fixture(scope="session")
def stack(local_stack: LocalStack) -> StackInfo:
    """Addresses and credentials of the session's stack."""
    return local_stack.info()
