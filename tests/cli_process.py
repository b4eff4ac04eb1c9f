"""The real ``reprolane`` in a process of its own, as an operator, an auditor or a release engineer runs it: its own
interpreter, its own logging, exactly the environment the test gives (`typer.testing.CliRunner` runs the command
inside pytest's process instead, sharing its imports and handlers). The one place the stack tests start a command
that runs to its end; long-running ones (``serve ...``, ``console``) are started and stopped by their own fixtures.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from infra.demo.services import reprolane_argv


def reprolane(
    *args: str, env: Mapping[str, str], timeout: float = 600, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``reprolane ARGS`` with exactly ``env``, no stdin, its stdout and stderr kept apart as text; not checked (the
    test asserts the exit code it expects). Raises `subprocess.TimeoutExpired` after ``timeout`` seconds."""
    return subprocess.run(
        [*reprolane_argv(), *args],
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
