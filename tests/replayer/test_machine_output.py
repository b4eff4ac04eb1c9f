"""`replayer.machine_output`: one document on stdout, everything else (Python, logging, file descriptor 1) on stderr.

A child process stands in for a lane: inside the context it prints, logs through a handler made on
``sys.stdout`` there (as vLLM's logger is made when vLLM is first imported), and writes to descriptor 1 with
``os.write`` (as C code and engine threads do). Only the document may reach its stdout.

The text report of ``reprolane replay request`` is held to the same rule (issue 30: it was printed after some 130
vLLM warning lines): the real root command line in a child process, its lane configuring vLLM's own logging as an
engine start does (``vllm.logger.configure_logging``, so this test needs the lanes extra, not a model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from replayer.machine_output import VLLM_LOGGING_STREAM, engine_logs_to_stderr, machine_output

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


def test_engine_logs_go_to_stderr_unless_the_user_chose_a_stream() -> None:
    environ: dict[str, str] = {}
    engine_logs_to_stderr(environ)
    assert environ == {VLLM_LOGGING_STREAM: "ext://sys.stderr"}
    chosen = {VLLM_LOGGING_STREAM: "ext://sys.stdout"}
    engine_logs_to_stderr(chosen)
    assert chosen == {VLLM_LOGGING_STREAM: "ext://sys.stdout"}


TEXT_REPLAY = textwrap.dedent(
    """
    import os
    from infra.cli.root import build_app
    from replayer.cli import build_replay_app
    from tests.replayer.support import FakeLane, make_envelope

    envelope = make_envelope(1)
    lane = FakeLane()
    lane.learn(envelope)

    class Store:
        def get_by_request_id(self, request_id):
            return envelope

        def get_result(self, envelope, lane_fingerprint_sha256):
            return None

        def put_result(self, envelope, result):
            return True

    def start_lane(settings):
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging, init_logger

        configure_logging(LoggingConfig())  # what every engine start does (vllm/v1/engine/core.py)
        init_logger("vllm.engine.fake").warning("ENGINE-LOG-LINE")
        os.write(1, b"ENGINE-FD-WRITE\\n")
        return lane

    print("REQUEST", envelope.request_id, flush=True)
    app = build_app({"replay": build_replay_app(lane_factory=start_lane, store_factory=lambda settings: Store())})
    app(["replay", "request", envelope.request_id, "--via", "local"], prog_name="reprolane")
    """
)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the lanes extra)")
def test_the_text_report_of_a_replay_is_not_buried_in_engine_logs() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    proc = subprocess.run(
        [sys.executable, "-c", TEXT_REPLAY], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, *report = proc.stdout.splitlines()
    request_id = first.removeprefix("REQUEST ")
    assert report[0].startswith(f"Replay of request {request_id} (envelope "), proc.stdout
    assert "Verdict: bitwise" in proc.stdout
    for engine_output in ("ENGINE-LOG-LINE", "ENGINE-FD-WRITE"):
        assert engine_output not in proc.stdout, proc.stdout
        assert engine_output in proc.stderr
