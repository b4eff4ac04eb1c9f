"""``reprolane demo --quick`` against the real stack: captured == sent, every flagged envelope replayed, the
summary and the auditor's command printed, the console started for the run (``--console``) and logged in to with
the key it printed, and every process the demo started gone afterwards (Ctrl-C included).

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

import httpx
import pytest

from infra import process
from infra.demo import Demo, DemoOptions
from infra.demo_services import Service, reprolane_argv
from infra.stack import LocalStack
from infra.state import StackInfo

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    return not process.is_alive(process.ProcessRef(pid, None)) and not process.group_alive(pid)


class ConsoleCheckedDemo(Demo):
    """The demo with ``--console``, where an auditor logs in with the printed key instead of waiting for Ctrl-C."""

    logged_in: dict[str, int]

    def serve_console(self, console: Service) -> None:
        out = self.outcome
        assert out.console_url is not None
        assert out.console_logins is not None
        self.logged_in = {}
        for role, path in out.console_logins.key_files.items():
            with httpx.Client(base_url=out.console_url, timeout=30.0) as client:
                form = client.get("/login")
                csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
                assert csrf is not None
                token = path.read_text().strip()
                client.post("/login", data={"csrf": csrf.group(1), "token": token}, follow_redirects=False)
                rid = out.auditor_request_id
                self.logged_in[role] = client.get(f"/requests/{rid}" if rid else "/search").status_code


def test_quick_demo_captures_every_request_replays_every_flagged_one_and_cleans_up(stack: StackInfo) -> None:
    lines: list[str] = []
    demo = ConsoleCheckedDemo(DemoOptions(run_dir=stack.run_dir, quick=True, timeout_s=300.0, console=True),
                              lines.append)  # fmt: skip
    outcome = demo.run()
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
    # the stack's vLLM records its schedule and the shipper ships it: the replayer rebuilds the batches (issue 22)
    scheduled = [e for e in outcome.events.values() if e.lane == "schedule"]
    assert scheduled, [e.cause_detail for e in outcome.events.values()]
    assert any(e.schedule_reproduced and e.verdict == "bitwise" for e in scheduled)
    assert "on the schedule lane" in text

    for verdict in ("bitwise", "token", "numeric", "diverged"):
        assert re.search(rf"verdicts .*{verdict} \d+", text), verdict
    assert outcome.auditor_request_id in outcome.events
    assert f"reprolane replay request {outcome.auditor_request_id}" in text
    assert f"Replay of request {outcome.auditor_request_id}" in text  # the CLI's real output
    assert outcome.auditor_exit == (0 if outcome.events[outcome.auditor_request_id].target_met else 1)

    # the console for the run: its URL and the key files printed, both keys log in and read the auditor's request
    assert outcome.console_url is not None
    assert outcome.console_logins is not None
    assert f"serves this run at {outcome.console_url}" in text
    for path in outcome.console_logins.key_files.values():
        assert str(path) in text
        assert path.stat().st_mode & 0o077 == 0
    assert demo.logged_in == {"viewer": 200, "hold-admin": 200}

    assert not outcome.stack_started
    assert len(outcome.services) == 4  # sidecar, schedule shipper, replayer, console
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
        assert len(pids) == 3, "".join(seen)  # the sidecar, the schedule shipper and the replayer are up
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
