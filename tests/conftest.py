"""Shared fixtures. The ``stack`` fixture owns the real local stack for a whole test session.

Started once (about a minute, most of it vLLM) and stopped at the end; every test that needs it gets
the same :class:`~infra.stack.state.StackInfo`. Tests must isolate themselves inside it (a uuid topic, a
uuid object key), never by restarting it, except the few stack tests that exercise restarts.

Set ``REPROLANE_TEST_RUN_DIR`` to attach to a stack you keep running (``reprolane stack up --run-dir``):
the fixture then only makes sure it is up and never takes it down. On a 2-core machine this avoids one vLLM
per pytest run. No test takes the session's stack down: ``down()`` is tested on a private stack, and the
session itself checks at the end that ``down()`` left no process group of the session's stack alive.

Under pytest-xdist (``make test`` runs ``-n``) the workers share one stack: the controller names its run dir
(`SHARED_ENV`), the first worker whose test needs it starts it (`LocalStack.up` holds the run dir's lock, so a
second worker waits and then finds it up), and the controller takes it down when every worker is done. The
tests are grouped for xdist's ``loadgroup`` (`pytest_collection_modifyitems`): the stack tests that send to the
stack's vLLM in one group that one worker runs in order (one test's traffic would change another's batches); the
model tests that run engines of their own, in process and without the stack, in a second; each stack module (or
test) marked ``beside_engines`` (no model, its own topics, keys and buckets) or ``own_engines`` (its engines are its
own: a private vLLM, an in-process lane; it sends nothing to the stack's vLLM) in a group of its own, named after its
module; unit tests anywhere. The stack group is the suite's longest chain: a test that need not send to the stack's
vLLM belongs beside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.stack import process
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo, StackState

# Tests that are not about authentication run the sidecar without it (`capture.request.auth`); those that are set
# auth_mode and a key file explicitly. Set before any CaptureSettings is built; subprocesses inherit it.
os.environ.setdefault("REPROLANE_CAPTURE_AUTH_MODE", "off")
# The workers' engines (the stack's vLLM, in-process lanes and production engines) share two cores: OpenMP threads
# that spin after a parallel region hold a core another engine waits for, so they sleep instead (the suite's time
# with and without: docs/OPERATIONS.md, "Tests"). The wait policy changes no number: the reduction order is the
# thread count's. Set before any engine or torch loads; the stack's servers inherit it. ACTIVE in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The OpenTelemetry SDK's batch processor exports every 5 s unless this standard variable says otherwise; the telemetry
# tests wait for each span to reach their receiver, so they would wait those 5 s each. Subprocesses inherit it.
os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "100")

#: Run dir of an already running stack to reuse instead of starting a private one.
ATTACH_ENV = "REPROLANE_TEST_RUN_DIR"
#: Run dir of the stack the xdist workers of one session share (set by the controller, `pytest_configure`).
SHARED_ENV = "REPROLANE_TEST_SHARED_STACK"


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist controller, name the run dir its workers' stack will use (they inherit the environment)."""
    if _is_xdist_controller(config) and not os.environ.get(ATTACH_ENV):
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="reprolane-test-stack-")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist controller, take the workers' shared stack down (if one of them started it) and fail the
    session if a process group of it survived."""
    shared = os.environ.get(SHARED_ENV)
    if not shared or not _is_xdist_controller(session.config):
        return
    try:
        if (Path(shared) / "stack.json").exists():
            _down_and_check(LocalStack(Path(shared)))
    except AssertionError as exc:
        session.config.get_terminal_writer().line(f"FAILED at session end: {exc}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    finally:
        shutil.rmtree(shared, ignore_errors=True)


#: xdist groups: the stack tests not marked with one of `MODULE_GROUPS`, and the model tests without the stack.
STACK_GROUP, MODEL_GROUP = "stack", "model"
#: The markers of stack modules that form an xdist group of their own, beside the stack group.
MODULE_GROUPS = {"beside_engines", "own_engines"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which turns each test's group into its node id
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each stack or model test in its xdist group (the module docstring); a ``beside_engines`` or ``own_engines``
    module's tests in one group of the module's name, so that its module fixtures (a private vLLM, a topic) start
    once."""
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        if marks & MODULE_GROUPS:
            module = getattr(item, "module", None)
            group = module.__name__ if module is not None else item.nodeid
        elif "stack" in marks:
            group = STACK_GROUP
        elif "model" in marks:
            group = MODEL_GROUP
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


def _is_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """The session's :class:`LocalStack`, up (S3, Kafka on S3 storage, vLLM CPU), down at the end (by the
    controller when xdist workers share it)."""
    attached = os.environ.get(ATTACH_ENV)
    shared = os.environ.get(SHARED_ENV) if os.environ.get("PYTEST_XDIST_WORKER") else None
    run_dir: Path = Path(attached or shared or tmp_path_factory.mktemp("stack"))
    stack = LocalStack(run_dir)
    try:
        stack.up()
        yield stack
    finally:
        if not attached and not shared:
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


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[tuple[LocalStack, StackInfo]]:
    """S3 and Kafka of the test's own (seconds to start), for a test that stops or restarts a server: the session's
    stack keeps serving the tests that run beside it."""
    private = LocalStack(tmp_path / "private-stack")
    try:
        yield private, private.up(servers=("s3", "kafka"))
    finally:
        private.down()
