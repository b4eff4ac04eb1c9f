"""Starting, watching and stopping one server process group, safely across CLI invocations.

Each server is started in a new session (``start_new_session=True``), so it leads its own process
group and we can signal it together with whatever it forks (vLLM runs its engine in a child process).
A :class:`ProcessRef` records the pid *and* the process start time from ``/proc/<pid>/stat``: a later
``reprolane stack down`` run from another shell must not signal an unrelated process that happens to
have inherited a recycled pid.

"Alive" means: the pid exists, it is the same process (start time matches), and it is not a zombie.
A dead child of this very Python process would stay a zombie (and ``kill(pid, 0)`` would still
succeed) until reaped, so children started here are kept in :data:`_CHILDREN` and polled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from infra.errors import ServerStartError, ServerStopError

#: Popen objects of the servers started by this Python process, so they can be reaped (no zombies).
_CHILDREN: dict[int, subprocess.Popen[Any]] = {}


@dataclass(frozen=True)
class ProcessRef:
    """A process we started: its pid (== its process group id) and its kernel start time."""

    pid: int
    start_ticks: int | None


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces or ')': split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].startswith("Z")


def spawn(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> ProcessRef:
    """Start ``argv`` in its own session, stdout and stderr appended to ``log_path``."""
    return _start(argv, env, log_path, cwd, piped=False)[0]


def spawn_piped(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path
) -> tuple[ProcessRef, subprocess.Popen[str]]:
    """Like `spawn`, but its stdout is a text pipe the caller reads (stderr is still appended to ``log_path``);
    the caller closes the pipe and ends with `stop` (it returns at once for a child that has exited)."""
    ref, proc = _start(argv, env, log_path, cwd, piped=True)
    return ref, cast("subprocess.Popen[str]", proc)


def _start(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path, *, piped: bool
) -> tuple[ProcessRef, subprocess.Popen[Any]]:
    """The one place a process group is started: its own session, stdin closed, output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(argv)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if piped else log,
                stderr=log if piped else subprocess.STDOUT,
                start_new_session=True,
                text=piped,
            )
        except OSError as exc:
            raise ServerStartError(f"cannot execute {argv[0]}: {exc}") from exc
    _CHILDREN[proc.pid] = proc
    return ProcessRef(pid=proc.pid, start_ticks=start_ticks(proc.pid)), proc


def is_alive(ref: ProcessRef) -> bool:
    """True while the process ``ref`` names is running (not exited, not a zombie, not a recycled pid)."""
    child = _CHILDREN.get(ref.pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[ref.pid]
        return False
    try:
        os.kill(ref.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # exists but is not ours: certainly not our server
    if _is_zombie(ref.pid):
        return False
    return ref.start_ticks is None or start_ticks(ref.pid) == ref.start_ticks


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (a reaped leader can leave children behind)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(ref: ProcessRef, deadline: float) -> bool:
    """Poll until the leader is dead and its group is empty, or ``deadline`` passes."""
    while True:
        leader_dead = not is_alive(ref)
        if leader_dead and not group_alive(ref.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def stop(ref: ProcessRef, timeout_s: float, kill_timeout_s: float = 5.0) -> None:
    """SIGTERM the group of ``ref``, wait up to ``timeout_s``, then SIGKILL; raise if anything survives.

    A recycled pid (start time differs) is never signalled; only its old group is, and only if that
    group still has members (a group id cannot be reused while its group exists).
    """
    if is_alive(ref):
        _signal_group(ref.pid, signal.SIGTERM)
    elif group_alive(ref.pid) and start_ticks(ref.pid) in (None, ref.start_ticks):
        _signal_group(ref.pid, signal.SIGTERM)  # leader gone, orphans of our group left
    else:
        _CHILDREN.pop(ref.pid, None)
        return
    if _wait_gone(ref, time.monotonic() + timeout_s):
        _CHILDREN.pop(ref.pid, None)
        return
    _signal_group(ref.pid, signal.SIGKILL)
    if not _wait_gone(ref, time.monotonic() + kill_timeout_s):
        raise ServerStopError(f"process group {ref.pid} is still alive after SIGTERM and SIGKILL")
    _CHILDREN.pop(ref.pid, None)


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ('' when there is none), read from its end."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-lines:])


def write_pid_file(path: Path, ref: ProcessRef) -> None:
    """``<pid>\\n`` in ``path`` (for humans and other tools; stack.json is the source of truth)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{ref.pid}\n")
