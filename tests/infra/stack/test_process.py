"""Process supervision: a whole group is stopped, and a dead child is not reported alive."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from infra.stack import process

# A parent that forks a child into its own group, then both sleep: like vLLM and its engine.
FORKING_SLEEPER = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nelse:\n    time.sleep(60)\n"


def test_stop_kills_the_whole_group(tmp_path: Path) -> None:
    ref = process.spawn([sys.executable, "-c", FORKING_SLEEPER], dict(os.environ), tmp_path / "x.log", tmp_path)
    time.sleep(0.3)
    assert process.is_alive(ref)
    assert process.group_alive(ref.pid)
    process.stop(ref, timeout_s=5)
    assert not process.is_alive(ref)
    assert not process.group_alive(ref.pid)


def test_exited_child_is_dead_not_zombie(tmp_path: Path) -> None:
    ref = process.spawn([sys.executable, "-c", "print('bye')"], dict(os.environ), tmp_path / "y.log", tmp_path)
    deadline = time.monotonic() + 10
    while process.is_alive(ref) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process.is_alive(ref)
    assert "bye" in process.log_tail(tmp_path / "y.log")


def test_recycled_pid_is_not_ours() -> None:
    me = process.ProcessRef(os.getpid(), (process.start_ticks(os.getpid()) or 0) + 1)
    assert not process.is_alive(me)


def test_a_piped_child_hands_its_stdout_to_the_caller_and_its_stderr_to_the_log(tmp_path: Path) -> None:
    code = "import os, sys\nprint('answer')\nprint('chatter', file=sys.stderr)\nprint(os.getpgid(0) == os.getpid())"
    ref, proc = process.spawn_piped([sys.executable, "-c", code], dict(os.environ), tmp_path / "z.log", tmp_path)
    assert proc.stdout is not None
    with proc.stdout:
        assert proc.stdout.read().splitlines() == ["answer", "True"]  # its own process group, like `spawn`
    assert proc.wait(timeout=10) == 0
    assert not process.is_alive(ref)
    assert "chatter" in process.log_tail(tmp_path / "z.log")


def test_a_piped_child_still_running_is_stopped_with_its_group(tmp_path: Path) -> None:
    ref, proc = process.spawn_piped(
        [sys.executable, "-c", FORKING_SLEEPER], dict(os.environ), tmp_path / "w.log", tmp_path
    )
    time.sleep(0.3)
    process.stop(ref, timeout_s=5)
    proc.wait(timeout=5)
    assert proc.stdout is not None
    proc.stdout.close()
    assert not process.group_alive(ref.pid)
