"""The local quarantine: where a record that a sink refuses for good goes, so the publisher can move on.

A record Kafka or S3 will never take (too large, a key S3 refuses, a record that is not an envelope) would
otherwise be retried forever and block every record behind it in the spool. The publisher hands it here
instead, with its reason, and acks it only once it is durable here:

    <spool_dir>.quarantine/<sha256>.record              the record's bytes as the sinks saw them (sealed for an
                                                        encrypted tenant), written once
    <spool_dir>.quarantine/<sha256>.<sink>.reason.json  {"seq", "sink", "code", "reason", "envelope_id",
                                                        "request_id", "tenant", "size", "quarantined_at"}

``<sha256>`` is the sha256 of the record bytes, so a redelivery (a crash between this write and the ack) lands
on the same files and changes nothing. Files are 0600 in a 0700 directory, written under a temporary name,
fsynced and hard-linked into place (so never partial, never replaced), and the directory is fsynced before
`keep` returns. The publisher then also sends the record to the dead-letter topic
(`capture.publishing.kafka_sink.KafkaSink.dead_letter`) when Kafka takes it, and counts it in
``records_quarantined_total{sink,code}`` (alert ``ReprolaneRecordsQuarantined``). An operator reads the reason,
fixes what made the sink refuse, and republishes by hand; nothing here is ever deleted by reprolane.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from capture.errors import CaptureError


def quarantine_dir(spool_dir: Path) -> Path:
    """The quarantine next to a spool directory (never inside it: the spool owns its directory)."""
    return spool_dir.with_name(f"{spool_dir.name}.quarantine")


@dataclass(frozen=True)
class Refusal:
    """One record a sink refused for good, and why."""

    seq: int
    payload: bytes
    sink: str
    code: str
    reason: str
    envelope_id: str | None = None
    request_id: str | None = None
    tenant: str | None = None

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.payload).hexdigest()

    def reason_json(self) -> bytes:
        doc = {
            "seq": self.seq,
            "sink": self.sink,
            "code": self.code,
            "reason": self.reason,
            "envelope_id": self.envelope_id,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "size": len(self.payload),
            "sha256": self.digest,
            "quarantined_at": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        }
        return json.dumps(doc, sort_keys=True, indent=1).encode()


class Quarantine:
    """Write-once files of refused records (see module docstring); blocking: call it in a thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def keep(self, refusals: list[Refusal]) -> list[Path]:
        """Make each refusal durable here; the record files. `CaptureError` when the disk refuses (the publisher
        then retries, and the records stay in the spool)."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.directory, 0o700)
            paths = []
            for refusal in refusals:
                record = self.directory / f"{refusal.digest}.record"
                _write_once(record, refusal.payload)
                _write_once(self.directory / f"{refusal.digest}.{refusal.sink}.reason.json", refusal.reason_json())
                paths.append(record)
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise CaptureError(f"quarantine {self.directory}: cannot keep refused records: {exc}") from exc
        return paths


def _write_once(path: Path, data: bytes) -> None:
    """Create `path` with `data` (0600, fsynced) atomically: written to a temporary name, then hard-linked
    into place, so a crash never leaves a partial file under the final name; an existing file is kept (the first
    write wins)."""
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
