"""The stack's state file, ``<run-dir>/stack.json``: the single source of truth about a running stack.

It is written by ``up``/``start``/``stop`` (atomically: temp file + rename) and read by everything else:
``status`` and ``down`` from another shell, test fixtures, and any tool that needs an address. Clients
should read :class:`StackInfo` (addresses and credentials, nothing about processes) through
:meth:`StackInfo.load`; :class:`StackState` adds the per-server process records the launcher needs.

Both hold the S3 secret, so the run dir is private: it is made (and kept) mode 0700, and ``stack.json`` and
``s3_secret_key`` are written 0600 whatever the umask (docs/SECURITY.md).

Layout of a run dir::

    <run-dir>/stack.json          this state (0600)
    <run-dir>/s3_secret_key       the S3 secret alone (0600): the services read it as REPROLANE_*_S3_SECRET_KEY_FILE
    <run-dir>/stack.lock          flock held while a command changes the stack
    <run-dir>/pids/<name>.pid     one pid per running server (informational)
    <run-dir>/logs/<name>.log     each server's stdout and stderr, appended across restarts
    <run-dir>/data/<name>/        server data (SeaweedFS volumes; Tansu keeps its data in S3)
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from infra import paths
from infra.errors import StackError, StackNotRunningError
from infra.stack.buckets import S3Credentials
from infra.stack.ports import HOST
from infra.stack.process import ProcessRef

ServerName = Literal["s3", "kafka", "vllm"]
#: Start order: Tansu keeps its data in S3, so S3 comes first; vLLM is independent but slowest.
SERVER_ORDER: tuple[ServerName, ...] = ("s3", "kafka", "vllm")
KafkaStorage = Literal["s3", "memory"]

STATE_FILE = "stack.json"
STATE_VERSION = 1
S3_SECRET_FILE = "s3_secret_key"
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_run_dir(run_dir: Path) -> None:
    """Make `run_dir` (and missing parents) and set it to mode 0700: only its owner lists or opens what is in it."""
    run_dir.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    if run_dir.stat().st_mode & 0o777 != PRIVATE_DIR_MODE:
        os.chmod(run_dir, PRIVATE_DIR_MODE)


def write_private(target: Path, text: str) -> None:
    """Write `target` atomically (temp file + rename) with mode 0600 from the start, whatever the umask."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # an existing temp file keeps its mode through O_CREAT
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, target)


def s3_secret_file(run_dir: Path, secret: str) -> Path:
    """``<run_dir>/s3_secret_key``, written (0600) when missing: what the services read the S3 secret from."""
    target = run_dir / S3_SECRET_FILE
    if not target.is_file() or target.read_text(encoding="utf-8") != secret:
        write_private(target, secret)
    return target


class ServerRecord(BaseModel):
    """One server of the stack: its fixed ports and, while it runs, its process."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: ServerName
    ports: dict[str, int]
    url: str
    log: Path
    pid_file: Path
    pid: int | None = None
    start_ticks: int | None = None

    @property
    def process(self) -> ProcessRef | None:
        """The recorded process, or None when the server was never started or was stopped."""
        return None if self.pid is None else ProcessRef(self.pid, self.start_ticks)


class StackInfo(BaseModel):
    """What a client of the stack needs: addresses, credentials, buckets, the model. No pids."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    run_dir: Path
    kafka_bootstrap: str
    kafka_storage: KafkaStorage
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_region: str
    audit_bucket: str
    tansu_bucket: str
    #: Root URL of the OpenAI-compatible server (append ``/v1``); None when started with ``--no-vllm``.
    vllm_url: str | None
    model_name: str
    model_dir: Path | None
    #: SeaweedFS's Iceberg REST catalog; None for a stack recorded before the catalog joined it.
    iceberg_url: str | None = None

    @property
    def s3_credentials(self) -> S3Credentials:
        """The S3 credentials as one object (what :func:`infra.stack.buckets.s3_client` takes)."""
        return S3Credentials(access_key=self.s3_access_key, secret_key=self.s3_secret_key, region=self.s3_region)

    @classmethod
    def load(cls, run_dir: Path | None = None) -> StackInfo:
        """Read the info of the stack in ``run_dir`` (default :func:`infra.paths.run_dir`)."""
        return StackState.load(paths.run_dir(run_dir)).info()


class StackState(BaseModel):
    """Everything in ``stack.json``: settings chosen at the first ``up`` plus one record per server."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state_version: int = STATE_VERSION
    run_dir: Path
    created_at: datetime
    credentials: S3Credentials
    audit_bucket: str
    tansu_bucket: str
    kafka_storage: KafkaStorage
    model_name: str
    model_dir: Path | None
    servers: dict[ServerName, ServerRecord]

    def url(self, name: ServerName) -> str | None:
        """URL of server ``name``, or None when it is not part of this stack."""
        record = self.servers.get(name)
        return None if record is None else record.url

    def info(self) -> StackInfo:
        """The client view. Raises :class:`StackError` when S3 or Kafka is not part of the stack."""
        s3_url, kafka_url = self.url("s3"), self.url("kafka")
        if s3_url is None or kafka_url is None:
            raise StackError(f"{self.run_dir}: the stack has no s3/kafka server records")
        return StackInfo(
            run_dir=self.run_dir,
            kafka_bootstrap=kafka_url,
            kafka_storage=self.kafka_storage,
            s3_endpoint=s3_url,
            s3_access_key=self.credentials.access_key,
            s3_secret_key=self.credentials.secret_key,
            s3_region=self.credentials.region,
            audit_bucket=self.audit_bucket,
            tansu_bucket=self.tansu_bucket,
            vllm_url=self.url("vllm"),
            model_name=self.model_name,
            model_dir=self.model_dir,
            iceberg_url=self._iceberg_url(),
        )

    def _iceberg_url(self) -> str | None:
        port = self.servers["s3"].ports.get("iceberg") if "s3" in self.servers else None
        return f"http://{HOST}:{port}" if port else None

    def with_server(self, record: ServerRecord) -> StackState:
        """A copy with ``record`` replacing the server of the same name."""
        return self.model_copy(update={"servers": {**self.servers, record.name: record}})

    def save(self) -> None:
        """Write ``stack.json`` and ``s3_secret_key`` atomically (readers never see half a file), 0600 in a 0700
        run dir."""
        private_run_dir(self.run_dir)
        text = json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
        write_private(self.run_dir / STATE_FILE, text)
        s3_secret_file(self.run_dir, self.credentials.secret_key)

    @classmethod
    def load(cls, run_dir: Path) -> StackState:
        """Read ``<run_dir>/stack.json``; :class:`StackNotRunningError` when absent, StackError if bad."""
        target = run_dir / STATE_FILE
        try:
            raw = target.read_text()
        except FileNotFoundError:
            raise StackNotRunningError(f"no stack in {run_dir} (run `reprolane stack up`)") from None
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise StackError(f"{target}: unreadable state: {str(exc).splitlines()[0]}") from exc

    @classmethod
    def load_or_none(cls, run_dir: Path) -> StackState | None:
        """Like :meth:`load`, but None when there is no state file."""
        try:
            return cls.load(run_dir)
        except StackNotRunningError:
            return None
