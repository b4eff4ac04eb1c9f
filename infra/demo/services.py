"""The processes the demo starts: the capture sidecar, the replayer service, the audit side an auditor needs (the
checkpointer, the archiver), the auditor's CLI call, and (when asked) the auditors' console, with the operator
keys and the replay-request key the demo mints for it.

Each runs the real ``reprolane`` command line in a session of its own (`infra.stack.process.spawn`): Ctrl-C in the
terminal reaches only the demo, which then stops them by process group (SIGTERM, wait, SIGKILL) in its
``finally``. Their settings come from the stack's addresses (`infra.stack.env.stack_defaults`, which *replace*
whatever the demo's own environment holds: the stack named by ``--run-dir`` wins) plus the demo's choices.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from capture.audit.operators import OPERATOR_KEYS
from capture.ledger.key_file import new_key as new_operator_key
from capture.ledger.key_file import write_key_file
from capture.request.auth import new_key
from infra import paths
from infra.errors import DemoError
from infra.stack import process
from infra.stack.env import stack_defaults
from infra.stack.process import ProcessRef
from infra.stack.state import StackInfo

Echo = Callable[[str], None]
_SERVICE_PREFIXES = (
    "REPROLANE_CAPTURE_",
    "REPROLANE_REPLAYER_",
    "REPROLANE_SHIPPER_",
    "REPROLANE_CONSOLE_",
    "REPROLANE_OPERATOR_",
    "REPROLANE_AUDIT_",
    "REPROLANE_ARCHIVER_",
)
#: The operator keys a demo run mints for its console: one per role an auditor logs in with.
CONSOLE_ROLES = ("viewer", "hold-admin")


def reprolane_argv() -> list[str]:
    """How to run this installation's ``reprolane``: the console script next to the interpreter, if any."""
    script = Path(sys.executable).parent / "reprolane"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "from infra.cli.root import app; app()"]


def clean_environment(run_dir: Path) -> dict[str, str]:
    """This process's environment without any service setting, pointing the CLI at ``run_dir``'s stack."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SERVICE_PREFIXES)}
    env[paths.RUN_DIR_ENV] = str(run_dir)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


@dataclass
class Service:
    """One started service: its name, process, log and the URL that tells it is up."""

    name: str
    ref: ProcessRef
    log: Path
    ready_url: str
    ready_headers: Mapping[str, str] | None = None

    def alive(self) -> bool:
        return process.is_alive(self.ref)

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``ready_url`` until it answers 200; raise `DemoError` with the log tail on death or timeout."""
        started = time.monotonic()
        while True:
            if not self.ready_url:  # nothing to ask: up once it has lived through its start-up
                time.sleep(1.0)
                if not self.alive():
                    raise DemoError(f"{self.name} exited during start-up; last lines of {self.log}:\n{self.tail()}")
                return time.monotonic() - started
            if not self.alive():
                raise DemoError(f"{self.name} exited during start-up; last lines of {self.log}:\n{self.tail()}")
            try:
                if httpx.get(self.ready_url, headers=self.ready_headers, timeout=2.0).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > timeout_s:
                raise DemoError(f"{self.name} not ready after {timeout_s:.0f} s; see {self.log}")
            time.sleep(0.25)

    def tail(self, lines: int = 15) -> str:
        return process.log_tail(self.log, lines)

    def stop(self, timeout_s: float = 20.0) -> None:
        process.stop(self.ref, timeout_s)


def _spawn(name: str, args: Sequence[str], env: Mapping[str, str], log: Path, ready_url: str, cwd: Path,
           ready_headers: Mapping[str, str] | None = None) -> Service:  # fmt: skip
    ref = process.spawn([*reprolane_argv(), *args], env, log, cwd)
    return Service(name, ref, log, ready_url, ready_headers)


def write_demo_keys(path: Path, tenants: Sequence[str]) -> dict[str, str]:
    """A key file (0600) with one fresh API key per tenant (roles capture and flag: the workflows flag their
    steps); returns the keys by tenant. Fresh every run: only this run's workload holds them."""
    keys: dict[str, str] = {}
    entries = []
    for tenant in tenants:
        keys[tenant], entry = new_key(f"demo-{tenant}", tenant, ("capture", "flag"))
        entries.append(entry)
    write_key_file(path, entries)
    return keys


@dataclass(frozen=True)
class ConsoleLogins:
    """The operator key store of a demo run's console and, per role, the file (0600) holding its key."""

    keys_path: Path
    key_files: dict[str, Path]


def write_console_logins(directory: Path) -> ConsoleLogins:
    """Mint one operator key per `CONSOLE_ROLES` (every tenant: the demo's auditor sees the whole run) into
    ``operator-keys.json`` and write each key to ``console-<role>.key``, all 0600 and fresh every run (the
    format and the proof are `reprolane keys operator`'s, `capture.ledger.key_file`)."""
    entries, files = [], {}
    for role in CONSOLE_ROLES:
        key, entry = new_operator_key(OPERATOR_KEYS, f"demo-{role}", None, (role,))
        entries.append(entry)
        files[role] = directory / f"console-{role}.key"
        _write_private(files[role], key + "\n")
    write_key_file(directory / "operator-keys.json", entries)
    return ConsoleLogins(directory / "operator-keys.json", files)


def _write_private(path: Path, text: str) -> None:
    """`path` created (or replaced) readable by its owner only, holding `text`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a file of an earlier run, whatever its mode: replaced, never reopened
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)


@dataclass(frozen=True)
class ReplayKey:
    """A replay-request keys file and the id of the key in it that signs."""

    path: Path
    key_id: str


def write_replay_keys(path: Path) -> ReplayKey:
    """A replay-request keys file (0600, the replayer's format, `replayer.request_keys`) holding one fresh key
    with the ``replay`` role: the run's replayer accepts it, its console signs "replay now" with it. Fresh every
    run."""
    key_id = "demo-console"
    _write_private(path, json.dumps({key_id: {"secret": secrets.token_hex(32), "roles": ["replay"]}}) + "\n")
    return ReplayKey(path, key_id)


def start_console(info: StackInfo, logins: ConsoleLogins, *, port: int, log: Path, group_id: str | None = None,
                  replay_key: ReplayKey | None = None) -> Service:  # fmt: skip
    """``reprolane serve console`` on the stack's buckets, accepting the run's operator keys (`write_console_logins`);
    with `replay_key` its "replay now" asks the replayer service of `group_id` (signed with that key)."""
    env = {
        **clean_environment(info.run_dir),
        **stack_defaults(info),
        "REPROLANE_OPERATOR_KEYS_PATH": str(logins.keys_path),
    }
    if group_id is not None:
        env["REPROLANE_REPLAYER_GROUP_ID"] = group_id
    if replay_key is not None:
        env["REPROLANE_CONSOLE_REPLAY_KEYS_PATH"] = str(replay_key.path)
        env["REPROLANE_CONSOLE_REPLAY_KEY_ID"] = replay_key.key_id
    args = ["serve", "console", "--host", "127.0.0.1", "--port", str(port)]
    return _spawn("console", args, env, log, f"http://127.0.0.1:{port}/healthz", info.run_dir)


def start_capture(info: StackInfo, *, port: int, spool_dir: Path, sample_rate: float, flag_tenants: Sequence[str],
                  api_keys_path: Path, ready_key: str, log: Path,
                  settings_env: Mapping[str, str] | None = None) -> Service:  # fmt: skip
    """``reprolane serve capture`` in front of the stack's vLLM, guaranteed mode, Kafka + S3 sinks, callers
    authenticated by the keys of `api_keys_path` (`ready_key`: one of them, for the readiness probe).
    `settings_env` overrides the stack's defaults (a test's own bucket: ``REPROLANE_CAPTURE_S3_BUCKET``)."""
    env = {**clean_environment(info.run_dir), **stack_defaults(info), **(settings_env or {})}
    args = [
        "serve", "capture", "--port", str(port), "--mode", "guaranteed", "--spool-dir", str(spool_dir),
        "--sample-rate", str(sample_rate), "--sidecar-id", "demo-capture",
        "--auth-mode", "keys", "--api-keys-path", str(api_keys_path),
    ]  # fmt: skip
    for tenant in flag_tenants:
        args += ["--flag-tenant", tenant]
    ready, headers = f"http://127.0.0.1:{port}/v1/models", {"Authorization": f"Bearer {ready_key}"}
    return _spawn("capture sidecar", args, env, log, ready, info.run_dir, headers)


def start_schedule_shipper(info: StackInfo, *, metrics_port: int, log: Path) -> Service:
    """``reprolane serve schedules``: the stack's vLLM's schedule log to S3 and Kafka (up once its metrics
    answer)."""
    env = {**clean_environment(info.run_dir), **stack_defaults(info)}
    args = ["serve", "schedules", "--metrics-port", str(metrics_port)]
    return _spawn("schedule shipper", args, env, log, f"http://127.0.0.1:{metrics_port}/metrics", info.run_dir)


def start_replayer(info: StackInfo, *, group_id: str, metrics_port: int, log: Path, replay_key: ReplayKey | None = None,
                   settings_env: Mapping[str, str] | None = None) -> Service:  # fmt: skip
    """``reprolane serve replayer`` on the in-process vLLM lane (fixed schedule), flagged envelopes only; it acts
    on on-demand replay requests signed with `replay_key` (the console's "replay now"). `settings_env` overrides
    the settings here (a benchmark's ``REPROLANE_REPLAYER_SCHEDULE_REUSE_CACHE``)."""
    env = {
        **clean_environment(info.run_dir),
        **stack_defaults(info),
        "REPROLANE_REPLAYER_AUTO_OFFSET_RESET": "latest",  # the demo commits the group's start offsets itself
        "REPROLANE_REPLAYER_SESSION_TIMEOUT_MS": "2000",  # Tansu: fast group joins (shared/STACK.md §4)
        "REPROLANE_REPLAYER_HEARTBEAT_INTERVAL_MS": "500",
        "REPROLANE_REPLAYER_RETRY_BACKOFF_S": "0.5",
        # the stack's vLLM server keeps one core for its API process, so its engine runs cores - 1 threads: the
        # replayer's first engine fixes its process's count, and its schedule lanes must match production's
        "REPROLANE_REPLAYER_VLLM_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) - 1)),
    }
    if replay_key is not None:
        env["REPROLANE_REPLAYER_REPLAY_REQUEST_KEYS_PATH"] = str(replay_key.path)
    env.update(settings_env or {})
    args = [
        "serve", "replayer", "--lane", "vllm", "--flagged-only", "--group-id", group_id,
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    return _spawn("replayer", args, env, log, f"http://127.0.0.1:{metrics_port}/metrics", info.run_dir)


def start_checkpointer(info: StackInfo, *, every_s: float, metrics_port: int, log: Path) -> Service:
    """``reprolane serve checkpointer``: signs a C2SP checkpoint of every day log that grew, every `every_s`
    seconds, with the stack's audit signing key (``<run dir>/audit-signing.pem``, `infra.stack.env`)."""
    env = {**clean_environment(info.run_dir), **stack_defaults(info)}
    args = ["serve", "checkpointer", "--every", str(every_s), "--metrics-port", str(metrics_port)]
    return _spawn("checkpointer", args, env, log, f"http://127.0.0.1:{metrics_port}/metrics", info.run_dir)


def start_archiver(info: StackInfo, *, group_id: str, flush_s: float, log: Path) -> Service:
    """``reprolane serve archiver`` in consumer group `group_id` (the demo commits its start offsets), writing the
    lake every `flush_s` seconds. It serves no metrics: up is alive (`Service.ready_url` empty)."""
    env = {
        **clean_environment(info.run_dir),
        **stack_defaults(info),
        "REPROLANE_ARCHIVER_GROUP_ID": group_id,
        "REPROLANE_ARCHIVER_AUTO_OFFSET_RESET": "latest",  # the demo commits the group's start offsets itself
        "REPROLANE_ARCHIVER_FLUSH_SECONDS": str(flush_s),
        "REPROLANE_ARCHIVER_SESSION_TIMEOUT_MS": "2000",  # Tansu: fast group joins (shared/STACK.md §4)
        "REPROLANE_ARCHIVER_HEARTBEAT_INTERVAL_MS": "500",
    }
    return _spawn("archiver", ["serve", "archiver"], env, log, "", info.run_dir)


def run_cli(args: Sequence[str], run_dir: Path, echo: Echo, *, log: Path, timeout_s: float, indent: str = "  ") -> int:
    """Run ``reprolane ARGS`` as a user would (env: only ``REPROLANE_RUN_DIR``), echoing its stdout live.

    Its stderr, and vLLM's own logging (turned down to errors: the lane's start-up chatter is ~150 lines), go to
    ``log``: what is echoed is what the command answers.
    """
    env = {**clean_environment(run_dir), "VLLM_LOGGING_LEVEL": "ERROR"}
    ref, proc = process.spawn_piped([*reprolane_argv(), *args], env, log, run_dir)
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            echo(f"{indent}{line.rstrip()}")
            if time.monotonic() > deadline:
                raise DemoError(f"`reprolane {' '.join(args)}` took longer than {timeout_s:.0f} s")
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired as exc:
        raise DemoError(f"`reprolane {' '.join(args)}` took longer than {timeout_s:.0f} s") from exc
    finally:
        process.stop(ref, 5.0)  # at once when it has exited; else its group, as for the servers
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
