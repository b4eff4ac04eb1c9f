"""`replayer.machine_output`: one document on stdout, everything else (Python, logging, file descriptor 1) on stderr.

A child process stands in for a lane: inside the context it prints, logs through a handler made on
``sys.stdout`` there (as vLLM's logger is made when vLLM is first imported), and writes to descriptor 1 with
``os.write`` (as C code and engine threads do). Only the document may reach its stdout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replayer.machine_output import machine_output

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import logging, os, sys
    from replayer.machine_output import machine_output

    print("before", flush=True)
    with machine_output({enabled}) as document:
        print("engine print")
        handler = logging.StreamHandler(sys.stdout)
        logging.getLogger("engine").addHandler(handler)
        logging.getLogger("engine").warning("engine log")
        os.write(1, b"fd 1 write\\n")
        document('{{"verdict": "bitwise"}}')
    logging.getLogger("engine").warning("log after")
    print("after", flush=True)
    """
)


def run_child(enabled: bool) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD.format(enabled=enabled)], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_only_the_document_reaches_stdout_inside_the_context() -> None:
    proc = run_child(True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == 'before\n{"verdict": "bitwise"}\nafter\n'
    assert json.loads(proc.stdout.splitlines()[1]) == {"verdict": "bitwise"}
    for line in ("engine print", "engine log", "fd 1 write", "log after"):  # the handler stays bound to stderr
        assert line in proc.stderr


def test_without_json_nothing_moves() -> None:
    proc = run_child(False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "before", "engine print", "engine log", "fd 1 write", '{"verdict": "bitwise"}', "log after", "after"
    ]  # fmt: skip


def test_a_second_document_is_a_bug(capsys: pytest.CaptureFixture[str]) -> None:
    with machine_output(True) as document:
        document("{}")
        with pytest.raises(RuntimeError, match="exactly one document"):
            document("{}")
    assert capsys.readouterr().out == "{}\n"
