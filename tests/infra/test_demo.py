"""``reprolane demo --quick`` against the real stack: captured == sent, every flagged envelope replayed, the
summary and the auditor's command printed, and every process the demo started gone afterwards (Ctrl-C included).

The stack is the session's (``REPROLANE_TEST_RUN_DIR`` to attach to a running one): the demo reuses it and
must leave it running. About 1-3 minutes on 2 cores: two in-process vLLM lanes are loaded (service, auditor).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from infra import process
from infra.demo import DemoOptions, run_demo
from infra.demo_services import reprolane_argv
from infra.stack import LocalStack
from infra.state import StackInfo

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    return not process.is_alive(process.ProcessRef(pid, None)) and not process.group_alive(pid)


def test_quick_demo_captures_every_request_replays_every_flagged_one_and_cleans_up(stack: StackInfo) -> None:
    lines: list[str] = []
    outcome = run_demo(DemoOptions(run_dir=stack.run_dir, quick=True, timeout_s=300.0), lines.append)
    text = "\n".join(lines)

    sent_ids = {s.request_id for s in outcome.sent}
    assert len(sent_ids) == 8
    assert [s.error for s in outcome.sent if s.error] == []
    assert set(outcome.envelopes) == sent_ids  # every request captured, read back from Kafka
    assert outcome.in_s3 == len(sent_ids)  # ... and findable in S3 by request id
    workflow = [s for s in outcome.sent if s.workflow is not None]
    assert [s.step for s in workflow] == [1, 2]
    for s in workflow:
        env = outcome.envelopes[s.request_id]
        assert env.flag_reason == "header"
        assert env.workflow is not None
        assert env.workflow.step == s.step
    step1, step2 = (outcome.envelopes[s.request_id] for s in workflow)
    assert step1.prompt is not None
    assert step2.prompt is not None
    assert len(step2.prompt.token_ids) > len(step1.prompt.token_ids)  # step 2 carries step 1's answer

    assert outcome.expected  # the workflow steps at least
    assert outcome.expected == {rid for rid, env in outcome.envelopes.items() if env.flagged}
    assert set(outcome.events) == set(outcome.expected)  # every flagged envelope got its divergence event
    for rid, event in outcome.events.items():
        assert event.envelope_id == outcome.envelopes[rid].envelope_id()

    for verdict in ("bitwise", "token", "numeric", "diverged"):
        assert re.search(rf"verdicts .*{verdict} \d+", text), verdict
    assert outcome.auditor_request_id in outcome.events
    assert f"reprolane replay request {outcome.auditor_request_id}" in text
    assert f"Replay of request {outcome.auditor_request_id}" in text  # the CLI's real output
    assert outcome.auditor_exit == (0 if outcome.events[outcome.auditor_request_id].target_met else 1)

    assert not outcome.stack_started
    assert len(outcome.services) == 2
    for service in outcome.services:
        assert _gone(service.ref.pid), service.name
    assert all(s.health == "ready" for s in LocalStack(stack.run_dir).status())  # the reused stack stays up


def test_ctrl_c_stops_everything_the_demo_started(stack: StackInfo) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*reprolane_argv(), "demo", "--quick", "--run-dir", str(stack.run_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    pids: list[int] = []
    seen: list[str] = []
    deadline = time.monotonic() + 120
    try:
        for line in proc.stdout:
            seen.append(line)
            pids += [int(p) for p in re.findall(r"\(pid (\d+)", line)]
            if line.startswith("[4/6]") or time.monotonic() > deadline:
                break
        assert len(pids) == 2, "".join(seen)  # the sidecar and the replayer are up
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the foreground process
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest
    assert "everything the demo started has been stopped" in rest
    for pid in pids:
        assert _gone(pid), pid
    assert all(s.health == "ready" for s in LocalStack(stack.run_dir).status())
