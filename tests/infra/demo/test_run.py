"""``reprolane demo --quick`` against the real stack: captured == sent, every flagged envelope replayed, the
summary and the auditor's command printed, the console started for the run (``--console``) and logged in to with
the key it printed, and every process the demo started gone afterwards (Ctrl-C included).

What an auditor needs works with what the demo printed (issue 30): every envelope proves itself against a
checkpoint the demo's checkpointer signed with the key whose fingerprint it printed (``reprolane audit verify``), the
printed ``audit evidence export`` / ``audit evidence verify`` / ``query`` commands answer, and in the console (Chromium,
through Playwright) the search by tenant and time finds the run in the lake, the request's inclusion verifies,
"replay now" is answered by the run's replayer service, and "download evidence" gives a bundle that
``reprolane audit evidence verify`` accepts against the printed fingerprint.

The stack is the session's (``REPROLANE_TEST_RUN_DIR`` to attach to a running one): the demo reuses it and
must leave it running. About 1-3 minutes on 2 cores: two in-process vLLM lanes are loaded (service, auditor).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.demo.run import Demo, DemoOptions
from infra.demo.services import Service, reprolane_argv
from infra.stack import process
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo
from schemas import CapturedOutput
from tests.cli_process import reprolane

pytestmark = pytest.mark.stack

REPO = Path(__file__).resolve().parents[3]


def _gone(pid: int) -> bool:
    return not process.is_alive(process.ProcessRef(pid, None)) and not process.group_alive(pid)


CHROMIUM = "/usr/bin/chromium"


def run_printed(command: str, run_dir: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command as the demo printed it (``reprolane ...``), run with nothing but the stack's run dir set."""
    args = shlex.split(command)
    assert args[0] == "reprolane", command
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_")}
    env["REPROLANE_RUN_DIR"] = str(run_dir)
    return reprolane(*args[1:], env=env, cwd=cwd, timeout=180)


class ConsoleCheckedDemo(Demo):
    """The demo with ``--console``, where an auditor logs in with the printed key instead of waiting for Ctrl-C,
    then walks the console in Chromium (`walk`)."""

    logged_in: dict[str, int]
    walked: dict[str, Any]
    downloads: Path

    def serve_console(self, console: Service) -> None:
        out = self.outcome
        assert out.console_url is not None
        assert out.console_logins is not None
        self.walked = self.walk(out.console_url, out.console_logins.key_files["viewer"])
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

    def walk(self, url: str, key_file: Path) -> dict[str, Any]:
        """An auditor in Chromium: log in, search by tenant and time, open the replayed request, read its
        inclusion, replay it now, download its evidence (each answer kept for the test to judge)."""
        from playwright.sync_api import sync_playwright

        out = self.outcome
        rid = out.auditor_request_id
        assert rid is not None
        env = out.envelopes[rid]
        since = (env.captured_at.astimezone(UTC) - timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M")
        seen: dict[str, Any] = {}
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = browser.new_context(accept_downloads=True).new_page()
                page.set_default_timeout(120_000)
                page.goto(url + "login")
                page.fill("input[name=token]", key_file.read_text().strip())
                page.click("#login")
                page.goto(f"{url}search?tenant={env.tenant}&since={since}")
                seen["search"] = page.inner_text("#results")
                page.goto(f"{url}requests/{rid}")
                seen["inclusion"] = page.inner_text("#inclusion")
                seen["replay_reason"] = page.inner_text("#replay-reason")
                replays_before = page.locator("article.replay").count()
                page.click("#replay-now")
                seen["replay_notice"] = page.inner_text("#notice")
                seen["replays"] = (replays_before, page.locator("article.replay").count())
                with page.expect_download() as info:
                    page.click("#download-evidence")
                bundle = self.downloads / info.value.suggested_filename
                info.value.save_as(str(bundle))
                seen["bundle"] = bundle
            finally:
                browser.close()
        return seen


def test_quick_demo_captures_every_request_replays_every_flagged_one_and_cleans_up(stack: StackInfo,
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    lines: list[str] = []
    demo = ConsoleCheckedDemo(DemoOptions(run_dir=stack.run_dir, quick=True, timeout_s=300.0, console=True),
                              lines.append)  # fmt: skip
    demo.downloads = tmp_path / "browser"
    demo.downloads.mkdir()
    outcome = demo.run()
    text = "\n".join(lines)
    print(text)  # the demo's output: pytest shows it when an assertion fails

    sent_ids = {s.request_id for s in outcome.sent}
    assert len(sent_ids) == 8 + 2  # chat waves and a workflow, then the tool-calling agent's two steps
    assert [s.error for s in outcome.sent if s.error] == []
    assert set(outcome.envelopes) == sent_ids  # every request captured, read back from Kafka
    assert outcome.in_s3 == len(sent_ids)  # ... and findable in S3 by request id
    workflow = [s for s in outcome.sent if s.group == "workflow"]
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

    # the agent: step 1 forced a call the demo ran (its result is in step 2's prompt), both steps flagged, replayed
    call, answer = (s for s in outcome.sent if s.group == "agent")
    assert [c["function"]["name"] for c in call.tool_calls] == ["lookup_policy"], call.answer
    called = outcome.envelopes[call.request_id]
    assert called.sampling is not None
    assert called.sampling.constraint is not None
    assert called.sampling.constraint.tool_choice is not None
    assert isinstance(called.outcome, CapturedOutput)
    assert [c.name for c in called.outcome.choices[0].tool_calls or ()] == ["lookup_policy"]
    assert {call.request_id, answer.request_id} <= set(outcome.events)
    assert "tool calls run: lookup_policy" in text
    for step in (call, answer):  # each step of the agent loop replayed on its schedule, bit for bit
        event = outcome.events[step.request_id]
        assert (event.lane, event.verdict) == ("schedule", "bitwise"), event.cause_detail

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

    # the audit trail (issue 30): the stack's key, printed with its fingerprint; every envelope proved and archived
    key = outcome.audit_key
    assert key is not None
    assert key.path == stack.run_dir / "audit-signing.pem"
    assert key.path.stat().st_mode & 0o077 == 0
    assert f"its fingerprint, what verifiers pin: {key.fingerprint}" in text
    assert outcome.proved == len(sent_ids)
    assert f"proved {len(sent_ids)}/{len(sent_ids)} envelopes" in text
    assert outcome.archived == (len(sent_ids), len(outcome.events))
    assert outcome.verify_exit == 0  # `reprolane audit verify ID`, run by the demo as the auditor types it
    assert f"verified request {outcome.auditor_request_id}" in text
    export, check, query = outcome.auditor_commands[1:]
    for command in outcome.auditor_commands[1:]:
        assert command in text  # printed (after REPROLANE_RUN_DIR=... when the stack is not the default one)
    exported = run_printed(export, stack.run_dir, tmp_path)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    checked = run_printed(check, stack.run_dir, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith(f"verified request {outcome.auditor_request_id}")
    queried = run_printed(query, stack.run_dir, tmp_path)
    assert queried.returncode == 0, queried.stderr
    counted = {t: int(n) for t, n in re.findall(r"^(\S+)\s+(\d+)\s*$", queried.stdout, re.M)}
    assert sum(counted.values()) >= len(sent_ids), queried.stdout
    assert set(counted) >= {s.tenant for s in outcome.sent}

    # the console, in Chromium: search by tenant and time, inclusion, replay now, download evidence
    seen = demo.walked
    assert outcome.auditor_request_id in seen["search"]
    assert seen["inclusion"].startswith("included: verifies"), seen["inclusion"]
    assert "asks the running replayer service" in seen["replay_reason"]
    assert seen["replay_notice"].startswith("replayed by the replayer service"), seen["replay_notice"]
    assert seen["replays"][1] >= max(seen["replays"][0], 1)
    bundle_check = run_printed(f"reprolane audit evidence verify {seen['bundle']} --key-fingerprint {key.fingerprint}",
                               stack.run_dir, tmp_path)  # fmt: skip
    assert bundle_check.returncode == 0, bundle_check.stdout + bundle_check.stderr

    # the console for the run: its URL and the key files printed, both keys log in and read the auditor's request
    assert outcome.console_url is not None
    assert outcome.console_logins is not None
    assert f"serves this run at {outcome.console_url}" in text
    for path in outcome.console_logins.key_files.values():
        assert str(path) in text
        assert path.stat().st_mode & 0o077 == 0
    assert demo.logged_in == {"viewer": 200, "hold-admin": 200}

    assert not outcome.stack_started
    assert len(outcome.services) == 6  # sidecar, schedule shipper, replayer, checkpointer, archiver, console
    for service in outcome.services:
        assert _gone(service.ref.pid), service.name
    assert all(s.health == "ready" for s in LocalStack(stack.run_dir).status())  # the reused stack stays up


@contextmanager
def children_start_with_sigint_at_its_default() -> Iterator[None]:
    """As a shell starts a foreground command, whatever the suite inherited: a suite started in the background of a
    non-interactive shell (``make test &``, a CI runner's) ignores SIGINT, an ignored signal stays ignored in a
    child, and a Python child that starts with SIGINT ignored never turns Ctrl-C into KeyboardInterrupt. A signal
    caught here is at its default in an exec'd child, so this process catches SIGINT while it starts one (no
    ``preexec_fn``: that runs Python between fork and exec, which is unsafe beside the worker's threads)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_everything_the_demo_started(stack: StackInfo) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with children_start_with_sigint_at_its_default():
        proc = subprocess.Popen(
            [*reprolane_argv(), "demo", "--quick", "--run-dir", str(stack.run_dir)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    assert proc.stdout is not None
    pids: list[int] = []
    seen: list[str] = []
    deadline = time.monotonic() + 300  # five services start, one of them an engine: slow beside other tests
    try:
        for line in proc.stdout:
            seen.append(line)
            pids += [int(p) for p in re.findall(r"\(pid (\d+)", line)]
            if line.startswith("[4/6]") or time.monotonic() > deadline:
                break
        assert len(pids) == 5, "".join(seen)  # sidecar, schedule shipper, replayer, checkpointer, archiver are up
        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the foreground process
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:  # an assertion failed: Ctrl-C all the same, so the demo stops what it started
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest
    assert "everything the demo started has been stopped" in rest
    for pid in pids:
        assert _gone(pid), pid
    assert all(s.health == "ready" for s in LocalStack(stack.run_dir).status())
