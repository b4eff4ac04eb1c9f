"""Shared fixtures. The ``stack`` fixture owns the real local stack for a whole test session.

Started once (about a minute, most of it vLLM) and stopped at the end; every test that needs it gets
the same :class:`~infra.state.StackInfo`. Tests must isolate themselves inside it (a uuid topic, a
uuid object key), never by restarting it, except the few stack tests that exercise restarts.

Set ``REPROLANE_TEST_RUN_DIR`` to attach to a stack you keep running (``reprolane stack up --run-dir``):
the fixture then only makes sure it is up, never takes it down, and the test that calls ``down()``
skips itself. On a 2-core machine this avoids one vLLM per pytest run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import LocalStack
from infra.state import StackInfo

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
            stack.down()


@pytest.fixture(scope="session")
def stack(local_stack: LocalStack) -> StackInfo:
    """Addresses and credentials of the session's stack."""
    return local_stack.info()
