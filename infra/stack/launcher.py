"""The local stack: SeaweedFS (S3), Tansu (Kafka) and vLLM CPU as real processes on 127.0.0.1.

:class:`LocalStack` is the one entry point, used by ``reprolane stack ...`` and by the test fixtures::

    stack = LocalStack(run_dir)
    info = stack.up()                 # idempotent: starts only what is not already running and ready
    stack.stop_server("kafka")        # e.g. to test the capture sidecar against a broker outage
    stack.start_server("kafka")       # same port as before, so clients reconnect to the same address
    stack.down()                      # SIGTERM, wait, SIGKILL, verify every process group is gone

Every operation re-reads ``stack.json`` under an exclusive lock, so two shells (or a test and a
developer) can never start duplicate servers. Ports are drawn once, when a server first joins the
stack, and kept until ``down``: a restarted server comes back on the same address. ``down`` removes
the state file; the data (SeaweedFS volumes, and through them Tansu's topics) stays in the run dir.
"""

from __future__ import annotations

import fcntl
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from infra import paths
from infra.errors import ServerStartError, StackError, StackNotRunningError
from infra.stack import process
from infra.stack.buckets import AUDIT_BUCKET, TANSU_BUCKET, S3Credentials, ensure_buckets, ensure_table_bucket
from infra.stack.ports import allocate_ports, require_free
from infra.stack.servers import SERVERS
from infra.stack.state import SERVER_ORDER, STATE_FILE, KafkaStorage, ServerName, ServerRecord, StackInfo, StackState
from infra.stack.topics import ensure_topics
from schemas.layout import LAKE_BUCKET

Reporter = Callable[[str], None]
ServerHealth = Literal["ready", "running", "dead", "stopped"]
_POLL_S = 0.25


def _quiet(_message: str) -> None:
    """Default reporter: say nothing."""


@dataclass(frozen=True)
class ServerStatus:
    """One line of ``reprolane stack status``.

    ``health``: ``ready`` (alive and answering), ``running`` (alive, not answering yet), ``dead``
    (recorded pid is gone: it crashed or was killed), ``stopped`` (stopped on purpose).
    """

    name: ServerName
    health: ServerHealth
    url: str
    pid: int | None
    log: Path
    log_tail: str


class LocalStack:
    """Start, inspect and stop the stack whose state lives in ``run_dir``."""

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        cache_dir: Path | None = None,
        kafka_storage: KafkaStorage = "s3",
        report: Reporter = _quiet,
    ) -> None:
        self.run_dir = paths.run_dir(run_dir)
        self.cache_dir = cache_dir
        self.kafka_storage: KafkaStorage = kafka_storage
        self.report = report

    # ----------------------------------------------------------------------------------- public API

    def up(self, servers: Iterable[ServerName] = SERVER_ORDER) -> StackInfo:
        """Make ``servers`` (plus ``s3`` when Kafka stores in S3) running and ready; return the info."""
        wanted = self._with_dependencies(servers)
        with self._lock():
            state = self._prepare_state(wanted)
            # every server is spawned before any is waited for, so that their starts overlap (vLLM's is the slow
            # one); only Kafka on S3 storage waits for S3 and its buckets first
            for name in SERVER_ORDER:
                if name in wanted and not self._stores_in_s3(name):
                    state = self._launch_unless_alive(state, name)
            if "s3" in wanted:
                state = self._ensure_ready(state, "s3")
                ensure_buckets(
                    state.url("s3") or "", state.credentials, state.audit_bucket, (state.tansu_bucket, LAKE_BUCKET)
                )
                if state.servers["s3"].ports.get("iceberg"):  # the Iceberg lake's warehouse
                    ensure_table_bucket(state.url("s3") or "", state.credentials)
            rest = [name for name in SERVER_ORDER if name in wanted and name != "s3"]
            for name in rest:
                if self._stores_in_s3(name):
                    state = self._launch_unless_alive(state, name)
            for name in rest:
                state = self._ensure_ready(state, name)
            if "kafka" in wanted:
                created = ensure_topics(state.info().kafka_bootstrap)
                if created:
                    self.report(f"created topics: {', '.join(created)}")
            return state.info()

    def down(self) -> None:
        """Stop every server (reverse start order), verify all groups are gone, remove the state file."""
        with self._lock():
            state = StackState.load_or_none(self.run_dir)
            if state is None:
                return
            for name in reversed(SERVER_ORDER):
                if name in state.servers:
                    state = self._stop(state, name)
            (self.run_dir / STATE_FILE).unlink(missing_ok=True)
            self.report(f"stack in {self.run_dir} is down")

    def status(self) -> list[ServerStatus]:
        """Health of each server of the stack. Raises :class:`StackNotRunningError` without a stack."""
        state = StackState.load(self.run_dir)
        result = []
        for name in SERVER_ORDER:
            record = state.servers.get(name)
            if record is None:
                continue
            health = self._health(state, record)
            tail = process.log_tail(record.log) if health == "dead" else ""
            result.append(ServerStatus(name, health, record.url, record.pid, record.log, tail))
        return result

    def info(self) -> StackInfo:
        """Addresses and credentials of the stack (from ``stack.json``)."""
        return StackState.load(self.run_dir).info()

    def start_server(self, name: ServerName) -> None:
        """Start one known server on its recorded ports (raises PortUnavailableError if taken)."""
        with self._lock():
            state = self._known(name)
            state = self._launch_unless_alive(state, name)
            self._ensure_ready(state, name)

    def stop_server(self, name: ServerName) -> None:
        """Stop one server; its ports stay recorded so :meth:`start_server` reuses them."""
        with self._lock():
            self._stop(self._known(name), name)

    def restart_server(self, name: ServerName) -> None:
        """Stop then start one server on the same ports."""
        self.stop_server(name)
        self.start_server(name)

    # ----------------------------------------------------------------------------------- internals

    def _stores_in_s3(self, name: ServerName) -> bool:
        """Whether ``name`` needs S3 (and its buckets) ready before it starts: Kafka on S3 storage."""
        return name == "kafka" and self.kafka_storage == "s3"

    def _with_dependencies(self, servers: Iterable[ServerName]) -> set[ServerName]:
        wanted = set(servers)
        unknown = wanted - set(SERVERS)
        if unknown:
            raise StackError(f"unknown server(s) {sorted(unknown)}; known: {', '.join(SERVER_ORDER)}")
        if any(self._stores_in_s3(name) for name in wanted):
            wanted.add("s3")
        return wanted

    def _known(self, name: ServerName) -> StackState:
        state = StackState.load(self.run_dir)
        if name not in state.servers:
            raise StackNotRunningError(f"server {name!r} is not part of the stack in {self.run_dir}")
        return state

    def _prepare_state(self, wanted: set[ServerName]) -> StackState:
        """Load or create the state, fetch the model if vLLM is wanted, draw ports for new servers."""
        state = StackState.load_or_none(self.run_dir)
        if state is None:
            state = StackState(
                run_dir=self.run_dir,
                created_at=datetime.now(UTC),
                credentials=S3Credentials(access_key="reprolane", secret_key=secrets.token_hex(16)),
                audit_bucket=AUDIT_BUCKET,
                tansu_bucket=TANSU_BUCKET,
                kafka_storage=self.kafka_storage,
                model_name=paths.MODEL_NAME,
                model_dir=None,
                servers={},
            )
        elif state.kafka_storage != self.kafka_storage:
            raise StackError(
                f"the stack in {self.run_dir} uses kafka storage {state.kafka_storage!r}; "
                f"run `reprolane stack down` before switching to {self.kafka_storage!r}"
            )
        if "vllm" in wanted:
            from infra.model.cache import ensure_model  # imported here: only vLLM needs the model

            manifest = ensure_model(self.cache_dir, report=self.report)
            state = state.model_copy(update={"model_dir": manifest.path})
        for name in SERVER_ORDER:
            if name in wanted and name not in state.servers:
                state = state.with_server(self._new_record(state, name))
        state.save()
        return state

    def _new_record(self, state: StackState, name: ServerName) -> ServerRecord:
        server = SERVERS[name]
        used = {
            port + offset
            for record in state.servers.values()
            for port in record.ports.values()
            for offset in SERVERS[record.name].port_offsets
        }
        numbers = allocate_ports(len(server.port_keys), server.port_offsets, exclude=frozenset(used))
        ports = dict(zip(server.port_keys, numbers, strict=True))
        return ServerRecord(
            name=name,
            ports=ports,
            url=server.url(ports),
            log=self.run_dir / "logs" / f"{name}.log",
            pid_file=self.run_dir / "pids" / f"{name}.pid",
        )

    def _health(self, state: StackState, record: ServerRecord) -> ServerHealth:
        ref = record.process
        if ref is None:
            return "stopped"
        if not process.is_alive(ref):
            return "dead"
        return "ready" if SERVERS[record.name].is_ready(state, record.ports) else "running"

    def _launch_unless_alive(self, state: StackState, name: ServerName) -> StackState:
        record = state.servers[name]
        ref = record.process
        if ref is not None and process.is_alive(ref):
            return state
        if ref is not None:
            self.report(f"{name}: recorded pid {ref.pid} is dead, restarting it")
            process.stop(ref, timeout_s=5.0)  # clears orphans its group may have left
        server = SERVERS[name]
        require_free(name, list(record.ports.values()), server.port_offsets)
        launch = server.launch(state, record.ports)
        ref = process.spawn(launch.argv, launch.env, record.log, launch.cwd)
        process.write_pid_file(record.pid_file, ref)
        self.report(f"{name}: started pid {ref.pid}, log {record.log}")
        state = state.with_server(record.model_copy(update={"pid": ref.pid, "start_ticks": ref.start_ticks}))
        state.save()
        return state

    def _ensure_ready(self, state: StackState, name: ServerName) -> StackState:
        """Launch if needed, then poll readiness; on death or timeout stop it and raise."""
        state = self._launch_unless_alive(state, name)
        record, server = state.servers[name], SERVERS[name]
        ref = record.process
        assert ref is not None  # just launched or found alive
        started = time.monotonic()
        deadline = started + server.ready_timeout_s
        while not server.is_ready(state, record.ports):
            if not process.is_alive(ref):
                process.stop(ref, timeout_s=5.0)  # only orphans of its group can be left; the record stays
                raise ServerStartError(
                    f"{name} exited during start-up; last lines of {record.log}:\n" + process.log_tail(record.log, 10)
                )
            if time.monotonic() > deadline:
                self._stop(state, name)
                raise ServerStartError(
                    f"{name} not ready after {server.ready_timeout_s:.0f} s (stopped it); see {record.log}"
                )
            time.sleep(_POLL_S)
        self.report(f"{name}: ready at {record.url} ({time.monotonic() - started:.1f} s)")
        return state

    def _stop(self, state: StackState, name: ServerName) -> StackState:
        record = state.servers[name]
        ref = record.process
        if ref is not None:
            process.stop(ref, SERVERS[name].stop_timeout_s)
            self.report(f"{name}: stopped pid {ref.pid}")
        record.pid_file.unlink(missing_ok=True)
        state = state.with_server(record.model_copy(update={"pid": None, "start_ticks": None}))
        state.save()
        return state

    @contextmanager
    def _lock(self) -> Iterator[None]:
        """Exclusive ``flock`` on ``<run-dir>/stack.lock`` for the duration of one operation."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with (self.run_dir / "stack.lock").open("w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
