"""``reprolane demo``: the whole product on one machine, end to end, in a few minutes.

1. the local stack (`infra.stack.launcher.LocalStack`: SeaweedFS, Tansu, vLLM CPU), reused when it already runs;
2. the capture sidecar in front of vLLM (the production lane: dynamic batching, bfloat16), guaranteed mode, with
   authentication on (a fresh API key per tenant in ``<run dir>/demo/api-keys.json``, 0600);
3. the replayer service on the in-process vLLM lane (the deterministic lane: one sequence at a time), in a fresh
   consumer group whose offsets are committed at the envelope topic's end first, so it replays exactly this run;
   it also answers on-demand requests signed with the run's replay-request key (``<run dir>/demo``, 0600), which
   the console's "replay now" signs with. Beside it what an auditor needs (`infra.demo.audit`): the stack's audit
   signing key (``<run dir>/audit-signing.pem``, made on the first run, its fingerprint printed), the
   checkpointer signing with it every few seconds, and an archiver writing this run into the lake (a fresh
   group started at the topics' ends, as the replayer's);
4. the bundled workload (`infra.demo.workload`) through the sidecar with the ``openai`` client and those keys;
5. wait until every flagged envelope has its divergence event (read back from Kafka), every envelope verifies
   against a signed checkpoint, and the lake holds the run;
6. the summary (`infra.demo.summary`), one replay by request id and one ``reprolane audit verify``, run as the auditor
   would type them, and the commands that export and check its evidence and query the lake;
7. the auditors' console for the run: a viewer and a hold-admin operator key minted into ``<run dir>/demo``
   (0600, `infra.demo.services.write_console_logins`), and how to start and open the console with them; with
   ``console=True`` (``reprolane demo --console``) the demo starts it itself and serves it until Ctrl-C, with the
   replayer, the archiver and the checkpointer still running, so that "replay now" is answered.

Everything the demo started is stopped at the end, on an error, and on Ctrl-C or SIGTERM (the services run in
sessions of their own, so the terminal's Ctrl-C reaches only the demo, which stops them by process group). The
stack is stopped only when the demo started it. ``keep=True`` leaves everything running.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from infra import paths
from infra.demo import audit as demo_audit
from infra.demo.kafka import Mark, collect, mark, start_group_at
from infra.demo.services import (
    ConsoleLogins,
    ReplayKey,
    Service,
    run_cli,
    start_archiver,
    start_capture,
    start_checkpointer,
    start_console,
    start_replayer,
    start_schedule_shipper,
    write_console_logins,
    write_demo_keys,
    write_replay_keys,
)
from infra.demo.summary import DemoFacts, auditor_pick, render_summary, worst
from infra.demo.workload import Sent, count_requests, drive, load_workload, tenants
from infra.errors import DemoError, InfraError
from infra.stack.launcher import LocalStack
from infra.stack.ports import allocate_ports, is_port_free
from infra.stack.servers import SCHEDULE_FILE
from infra.stack.state import StackInfo
from replayer.errors import ReplayerError
from replayer.report import render_divergence
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import ContractError, DivergenceEvent, Envelope, decode_divergence
from schemas.layout import TOPIC_DIVERGENCES, TOPIC_ENVELOPES

Echo = Callable[[str], None]
STEPS = 6


@dataclass(frozen=True)
class DemoOptions:
    run_dir: Path | None = None  # None: $REPROLANE_RUN_DIR or ./.reprolane/stack
    quick: bool = False  # 6 prompts, one workflow of 2 steps, 12 tokens (tests)
    keep: bool = False  # leave the services (and a stack the demo started) running
    timeout_s: float = 300.0  # for the next replay to arrive: the wait ends when none came for this long
    sample_rate: float = 0.34
    flag_tenants: tuple[str, ...] = ("health",)
    auditor_replay: bool = True
    console: bool = False  # start the console at the end and serve it until Ctrl-C


@dataclass
class DemoOutcome:
    run_id: str
    sent: list[Sent] = field(default_factory=list)
    envelopes: dict[str, Envelope] = field(default_factory=dict)
    events: dict[str, DivergenceEvent] = field(default_factory=dict)
    expected: frozenset[str] = frozenset()
    in_s3: int = 0
    summary: str = ""
    auditor_request_id: str | None = None
    auditor_exit: int | None = None
    audit_key: demo_audit.AuditKey | None = None
    proved: int = 0  # envelopes that verify against a signed checkpoint
    archived: tuple[int, int] = (0, 0)  # (envelopes, replays) of the run in the lake
    verify_exit: int | None = None
    auditor_commands: list[str] = field(default_factory=list)
    since: str = ""  # when the run's traffic started (UTC, the lake's query)
    group_id: str = ""
    replay_key: ReplayKey | None = None
    console_logins: ConsoleLogins | None = None
    console_url: str | None = None
    services: list[Service] = field(default_factory=list)
    stack_started: bool = False
    seconds: float = 0.0


def _stack_running(stack: LocalStack) -> bool:
    """True when any server of the stack in its run dir is alive (then the demo did not start it)."""
    try:
        return any(s.health in ("ready", "running") for s in stack.status())
    except InfraError:
        return False


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C (KeyboardInterrupt), so the same ``finally`` cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _uninterruptible() -> Iterator[None]:
    """Ignore Ctrl-C while cleaning up (a second Ctrl-C must not leave processes behind)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _store(info: StackInfo) -> EnvelopeStore:
    settings = ReplayerSettings(
        s3_endpoint=info.s3_endpoint, s3_access_key=info.s3_access_key, s3_secret_key=info.s3_secret_key,
        s3_region=info.s3_region, s3_bucket=info.audit_bucket, kafka_bootstrap=info.kafka_bootstrap,
    )  # fmt: skip
    return EnvelopeStore.from_settings(settings)


def _run_dir_prefix(run_dir: Path) -> str:
    return "" if run_dir == paths.run_dir(None) else f"{paths.RUN_DIR_ENV}={run_dir} "


def auditor_command(run_dir: Path, request_id: str) -> str:
    """The command line an auditor types: no flags when the stack is the default one."""
    return f"{_run_dir_prefix(run_dir)}reprolane replay request {request_id}"


#: Where ``reprolane serve console`` listens by default (`infra.console.settings.ConsoleSettings.port`).
CONSOLE_PORT = 8700


def console_lines(run_dir: Path, logins: ConsoleLogins, url: str | None, *, stack_stops: bool,
                  replayer: tuple[str, ReplayKey] | None = None) -> list[str]:  # fmt: skip
    """How to open the run's console: the URL it serves (`url`, when the demo started it) or the command that
    starts it, and the key files to log in with. `replayer`: the group and the replay-request key of the run's
    replayer when it keeps running (``--keep``), which the printed command hands to the console for "replay now"
    (otherwise the page says why it is off)."""
    keys = " or ".join(f"{path} ({role})" for role, path in logins.key_files.items())
    if url is not None:
        return [
            f"The auditors' console serves this run at {url} (Ctrl-C stops it and the demo).",
            f"  log in with the operator key in {keys}; 'replay now' asks the run's replayer, still running",
        ]
    replay = ""
    if replayer is not None:
        group, key = replayer
        replay = (f"REPROLANE_REPLAYER_GROUP_ID={group} REPROLANE_CONSOLE_REPLAY_KEYS_PATH={key.path} "
                  f"REPROLANE_CONSOLE_REPLAY_KEY_ID={key.key_id} ")  # fmt: skip
    operators = f"REPROLANE_OPERATOR_KEYS_PATH={logins.keys_path}"
    command = f"{_run_dir_prefix(run_dir)}{operators} {replay}reprolane serve console"
    lines = [
        "The auditors' console for this run:",
        f"  $ {command}",
        f"  then open http://127.0.0.1:{CONSOLE_PORT}/ and log in with the operator key in {keys}",
        "  (or `reprolane demo --console`: the demo starts it and serves it until Ctrl-C, 'replay now' included)",
    ]
    if replayer is None:
        lines.append("  'replay now' needs the run's replayer, which the demo has stopped: --console or --keep")
    if stack_stops:
        lines.append("  the demo stops the stack it started: `reprolane stack up` first (or --keep)")
    return lines


class Demo:
    """One run of the demo (see module docstring); `run` is the entry point."""

    def __init__(self, options: DemoOptions, echo: Echo) -> None:
        self.options = options
        self.echo = echo
        self.outcome = DemoOutcome(run_id=f"demo-{uuid.uuid4().hex[:8]}")
        self.stack = LocalStack(options.run_dir, report=lambda m: echo(f"      {m}"))

    def step(self, n: int, text: str) -> None:
        self.echo(f"[{n}/{STEPS}] {text}")

    def run(self) -> DemoOutcome:
        started = time.monotonic()
        with _sigterm_interrupts():
            try:
                self._run()
            finally:
                with _uninterruptible():
                    self._cleanup()
                self.outcome.seconds = time.monotonic() - started
        self.echo(f"demo finished in {self.outcome.seconds:.0f} s")
        return self.outcome

    def _run(self) -> None:
        o, out, echo = self.options, self.outcome, self.echo
        self.step(1, f"starting the stack (SeaweedFS, Tansu, vLLM CPU) in {self.stack.run_dir} ...")
        t = time.monotonic()
        out.stack_started = not _stack_running(self.stack)
        info = self.stack.up()
        if info.vllm_url is None:
            raise DemoError(f"the stack in {info.run_dir} has no vLLM (started with --no-vllm)")
        how = "started" if out.stack_started else "already running, reused"
        echo(f"      stack {how} ({time.monotonic() - t:.1f} s)")
        out.audit_key = key = demo_audit.ensure_audit_key(info.run_dir)
        made = "made now" if key.made else "the stack's"
        echo(f"      audit signing key {key.path} ({made}; public key {key.public_path})")
        echo(f"      its fingerprint, what verifiers pin: {key.fingerprint}")

        marks = asyncio.run(mark(info.kafka_bootstrap, (TOPIC_ENVELOPES, TOPIC_DIVERGENCES)))
        out.group_id = group_id = f"reprolane-{out.run_id}"
        asyncio.run(start_group_at(info.kafka_bootstrap, group_id, marks[TOPIC_ENVELOPES]))
        archiver_group = f"reprolane-archiver-{out.run_id}"
        for topic in (TOPIC_ENVELOPES, TOPIC_DIVERGENCES):  # the archiver writes exactly this run into the lake
            asyncio.run(start_group_at(info.kafka_bootstrap, archiver_group, marks[topic]))
        capture_port, metrics_port, checkpointer_port = allocate_ports(3)
        demo_dir = info.run_dir / "demo"
        workload = load_workload(quick=o.quick)
        keys = write_demo_keys(demo_dir / "api-keys.json", tenants(workload))

        self.step(2, f"starting the capture sidecar in front of vLLM ({info.vllm_url}) ...")
        capture = start_capture(
            info, port=capture_port, spool_dir=demo_dir / "spool", sample_rate=o.sample_rate,
            flag_tenants=o.flag_tenants, api_keys_path=demo_dir / "api-keys.json", ready_key=next(iter(keys.values())),
            log=info.run_dir / "logs" / "demo-capture.log",
        )  # fmt: skip
        out.services.append(capture)
        seconds = capture.wait_ready(90.0)
        echo(
            f"      ready at http://127.0.0.1:{capture_port}/v1 (pid {capture.ref.pid}, {seconds:.1f} s);"
            f" API keys for {', '.join(keys)} in {demo_dir / 'api-keys.json'};"
            f" flags: header X-Reprolane-Flag, tenant {','.join(o.flag_tenants) or '-'}, sample {o.sample_rate:.0%}"
        )

        if (info.run_dir / SCHEDULE_FILE).is_file():  # the stack's vLLM records its schedule: ship it
            (shipper_port,) = allocate_ports(1)
            shipper_log = info.run_dir / "logs" / "demo-shipper.log"
            shipper = start_schedule_shipper(info, metrics_port=shipper_port, log=shipper_log)
            out.services.append(shipper)
            seconds = shipper.wait_ready(60.0)
            echo(f"      schedule shipper up (pid {shipper.ref.pid}, {seconds:.1f} s): vLLM's schedule log, to S3")

        self.step(3, "starting the replayer (in-process vLLM lane, one sequence at a time), the checkpointer, the "
                     "archiver ...")  # fmt: skip
        out.replay_key = write_replay_keys(demo_dir / "replay-request-keys.json")
        replayer = start_replayer(
            info, group_id=group_id, metrics_port=metrics_port, log=info.run_dir / "logs" / "demo-replayer.log",
            replay_key=out.replay_key,
        )  # fmt: skip
        out.services.append(replayer)
        seconds = replayer.wait_ready(60.0)
        echo(
            f"      up (pid {replayer.ref.pid}, metrics :{metrics_port}, group {group_id}, {seconds:.1f} s);"
            " its lane loads while the traffic flows"
        )
        checkpointer = start_checkpointer(
            info, every_s=demo_audit.CHECKPOINT_EVERY_S, metrics_port=checkpointer_port,
            log=info.run_dir / "logs" / "demo-checkpointer.log",
        )  # fmt: skip
        out.services.append(checkpointer)
        seconds = checkpointer.wait_ready(60.0)
        echo(f"      checkpointer up (pid {checkpointer.ref.pid}, {seconds:.1f} s): signs a C2SP checkpoint of the"
             f" Merkle log every {demo_audit.CHECKPOINT_EVERY_S:.0f} s with the audit key")  # fmt: skip
        archiver = start_archiver(
            info, group_id=archiver_group, flush_s=demo_audit.ARCHIVER_FLUSH_S,
            log=info.run_dir / "logs" / "demo-archiver.log",
        )  # fmt: skip
        out.services.append(archiver)
        seconds = archiver.wait_ready(60.0)
        echo(f"      archiver up (pid {archiver.ref.pid}, group {archiver_group}, {seconds:.1f} s): this run's"
             " envelopes and replays into the lake")  # fmt: skip

        total = count_requests(workload, quick=o.quick)
        self.step(4, f"driving the workload through the sidecar: {total} requests (run id {out.run_id}) ...")
        t = time.monotonic()
        out.since = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S+00")
        base_url = f"http://127.0.0.1:{capture_port}/v1"
        out.sent = asyncio.run(drive(base_url, info.model_name, out.run_id, workload, keys, quick=o.quick, echo=echo))
        traffic_s = time.monotonic() - t

        self.step(5, "waiting for the envelopes and the replays ...")
        t = time.monotonic()
        store = _store(info)
        self._read_envelopes(info, store, marks)
        self._read_events(info, marks)
        replay_s = time.monotonic() - t
        self._wait_for_audit(info, key)

        self.step(6, "summary")
        if not o.keep and not o.console:  # free the CPU for the auditor's replay below (the console needs them)
            self._stop_services()
        out.in_s3 = self._count_in_s3(store)
        details = {}
        for ev in worst(out.events, 3):
            result = store.get_result(out.envelopes[ev.request_id], ev.lane_fingerprint_sha256)
            if result is not None:
                details[ev.request_id] = render_divergence(out.envelopes[ev.request_id], result)
        facts = DemoFacts(
            out.run_id, out.sent, out.envelopes, out.in_s3, out.events, out.expected, traffic_s, replay_s,
            details=details,
        )  # fmt: skip
        out.summary = render_summary(facts)
        echo(out.summary.rstrip("\n"))
        if o.auditor_replay:
            self._auditor_replay(info)
        self._auditor_proof(info, key)
        self._console(info)

    def _read_envelopes(self, info: StackInfo, store: EnvelopeStore, marks: dict[str, Mark]) -> None:
        out = self.outcome
        ids = {s.request_id for s in out.sent}
        found = asyncio.run(
            collect(info.kafka_bootstrap, marks[TOPIC_ENVELOPES], ids.__contains__,
                    until=lambda f: len(f) >= len(ids), timeout_s=60.0)
        )  # fmt: skip
        for rid, body in found.items():
            try:
                out.envelopes[rid] = store.decode(body, f"{TOPIC_ENVELOPES} key {rid}")
            except (ContractError, ReplayerError) as exc:
                raise DemoError(f"envelope of {rid} on {TOPIC_ENVELOPES} cannot be read: {exc}") from exc
        out.expected = frozenset(rid for rid, env in out.envelopes.items() if env.flagged and env.replayable)
        flagged = sum(1 for e in out.envelopes.values() if e.flagged)
        self.echo(f"      captured {len(found)}/{len(ids)} envelopes; {flagged} flagged for replay")

    def _read_events(self, info: StackInfo, marks: dict[str, Mark]) -> None:
        out, expected = self.outcome, self.outcome.expected
        started = time.monotonic()
        state = {"shown": -1, "at": 0.0, "count": 0, "progress": started}
        stall_s = self.options.timeout_s

        def tick(found: dict[str, bytes]) -> bool:
            for service in out.services:
                if not service.alive():
                    raise DemoError(f"{service.name} died; last lines of {service.log}:\n{service.tail()}")
            now = time.monotonic()
            if len(found) != state["count"]:
                state["count"], state["progress"] = len(found), now
            changed = len(found) != state["shown"]
            if (changed and (now - state["at"] >= 5.0 or len(found) >= len(expected))) or now - state["at"] >= 15.0:
                note = "  (the lane is loading)" if not found else ""
                self.echo(f"      replayed {len(found)}/{len(expected)}  ({now - started:.0f} s){note}")
                state["shown"], state["at"] = len(found), now
            # a schedule replay rebuilds its whole busy period, so the wait is for progress, not for a fixed time
            return len(found) >= len(expected) or now - state["progress"] > stall_s

        found = asyncio.run(
            collect(info.kafka_bootstrap, marks[TOPIC_DIVERGENCES], expected.__contains__, until=tick,
                    timeout_s=stall_s * max(len(expected), 1))
        )  # fmt: skip
        for rid, body in found.items():
            out.events[rid] = decode_divergence(body)
        if len(found) < len(expected):
            self.echo(f"      no replay for {stall_s:.0f} s: stopped waiting at {len(found)}/{len(expected)} replayed")

    def _wait_for_audit(self, info: StackInfo, key: demo_audit.AuditKey) -> None:
        """Until every envelope of the run verifies against a signed checkpoint and the lake holds the run (or a
        minute passed: what was found is printed either way)."""
        out = self.outcome
        t = time.monotonic()
        out.proved = demo_audit.wait_until_proved(demo_audit.audit_store(info), list(out.envelopes), key.public_raw,
                                                  timeout_s=60.0)  # fmt: skip
        self.echo(f"      proved {out.proved}/{len(out.envelopes)} envelopes: each verifies against a checkpoint the"
                  f" checkpointer signed ({time.monotonic() - t:.1f} s)")  # fmt: skip
        t = time.monotonic()
        out.archived = demo_audit.wait_until_archived(demo_audit.lake(info), list(out.envelopes), list(out.events),
                                                      timeout_s=60.0)  # fmt: skip
        self.echo(f"      archived {out.archived[0]}/{len(out.envelopes)} envelopes and {out.archived[1]}/"
                  f"{len(out.events)} replays into the lake ({time.monotonic() - t:.1f} s)")  # fmt: skip

    def _count_in_s3(self, store: EnvelopeStore) -> int:
        count = 0
        for rid in self.outcome.envelopes:
            try:
                store.get_by_request_id(rid)
                count += 1
            except ReplayerError:
                pass
        return count

    def _auditor_replay(self, info: StackInfo) -> None:
        pick = auditor_pick(self.outcome.events)
        if pick is None:
            self.echo("  (nothing was replayed: no auditor replay to show)")
            return
        self.outcome.auditor_request_id = pick.request_id
        self.echo("")
        self.echo("An auditor replays one request by its id (a fresh process loads the deterministic lane first):")
        self.echo(f"  $ {auditor_command(info.run_dir, pick.request_id)}")
        log = info.run_dir / "logs" / "demo-auditor.log"
        code = run_cli(["replay", "request", pick.request_id], info.run_dir, self.echo, log=log, timeout_s=300.0)
        self.outcome.auditor_exit = code
        meaning = {0: "target level held", 1: "target level NOT held", 2: "no verdict"}.get(code, "?")
        self.echo(f"  (exit code {code}: {meaning})")

    def _auditor_proof(self, info: StackInfo, key: demo_audit.AuditKey) -> None:
        """``reprolane audit verify`` run as the auditor types it, then the commands that check the rest by hand."""
        out = self.outcome
        rid = out.auditor_request_id or next(iter(sorted(out.envelopes)), None)
        if rid is None:
            return
        prefix = _run_dir_prefix(info.run_dir)
        self.echo("")
        self.echo(f"An auditor proves the record (the audit key's fingerprint: {key.fingerprint}):")
        self.echo(f"  $ {prefix}reprolane audit verify {rid}")
        log = info.run_dir / "logs" / "demo-auditor.log"
        proofs: list[str] = []

        def shown(line: str) -> None:  # one consistency proof per pair of checkpoints of the day: counted here
            if line.lstrip().startswith("consistent: "):
                proofs.append(line)
            else:
                self.echo(line)

        out.verify_exit = run_cli(["verify", rid], info.run_dir, shown, log=log, timeout_s=120.0, indent="    ")
        if proofs:
            self.echo(f"      (and {len(proofs)} consistency proofs between the day's checkpoints, not shown here)")
        meaning = {0: "verified", 1: "a check FAILED", 2: "no verdict"}.get(out.verify_exit, "?")
        self.echo(f"  (exit code {out.verify_exit}: {meaning})")
        out.auditor_commands = demo_audit.auditor_commands(rid, key, out.since)
        self.echo("and exports its evidence, checks it offline, and finds the run in the lake:")
        for command in out.auditor_commands[1:]:
            self.echo(f"  $ {prefix}{command}")

    def _console(self, info: StackInfo) -> None:
        """Mint the run's console logins; start and serve the console when asked (see module docstring)."""
        out = self.outcome
        out.console_logins = logins = write_console_logins(info.run_dir / "demo")
        self.echo("")
        if not self.options.console:
            stack_stops = out.stack_started and not self.options.keep
            kept = (out.group_id, out.replay_key) if self.options.keep and out.replay_key is not None else None
            for line in console_lines(info.run_dir, logins, None, stack_stops=stack_stops, replayer=kept):
                self.echo(line)
            return
        port = CONSOLE_PORT if is_port_free(CONSOLE_PORT) else allocate_ports(1)[0]
        console = start_console(info, logins, port=port, log=info.run_dir / "logs" / "demo-console.log",
                                group_id=out.group_id, replay_key=out.replay_key)  # fmt: skip
        out.services.append(console)
        console.wait_ready(60.0)
        out.console_url = f"http://127.0.0.1:{port}/"
        for line in console_lines(info.run_dir, logins, out.console_url, stack_stops=False):
            self.echo(line)
        self.serve_console(console)

    def serve_console(self, console: Service) -> None:
        """Serve until Ctrl-C (or SIGTERM), then return so that the demo stops what it started; a console that
        exits on its own is an error."""
        try:
            while console.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            self.echo("console stopped")
            return
        raise DemoError(f"console exited; last lines of {console.log}:\n{console.tail()}")

    def _stop_services(self) -> None:
        for service in reversed(self.outcome.services):
            if service.alive():
                service.stop()

    def _cleanup(self) -> None:
        out = self.outcome
        if self.options.keep:
            alive = [s for s in out.services if s.alive()]
            for s in alive:
                self.echo(f"kept running: {s.name} pid {s.ref.pid} (log {s.log})")
            if alive:
                self.echo(f"stop them with: kill {' '.join(str(s.ref.pid) for s in alive)}")
            if out.stack_started:
                self.echo(f"stop the stack with: reprolane stack down --run-dir {self.stack.run_dir}")
            return
        stopping = [s for s in out.services if s.alive()]
        if stopping or out.stack_started:
            self.echo("stopping what the demo started ...")
        errors = []
        for service in reversed(out.services):
            try:
                service.stop()
            except InfraError as exc:
                errors.append(str(exc))
        if out.stack_started:
            try:
                self.stack.down()
            except InfraError as exc:
                errors.append(str(exc))
        if errors:
            raise DemoError("; ".join(errors))


def run_demo(options: DemoOptions, echo: Echo) -> DemoOutcome:
    """Run the demo (see module docstring); raises `DemoError` (an `InfraError`) when it cannot finish."""
    return Demo(options, echo).run()
