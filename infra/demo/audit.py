"""The demo's audit side: what lets its records prove themselves and be found afterwards (issue 30).

- **The audit signing key** (`ensure_audit_key`): ``<run dir>/audit-signing.pem`` (0600) and its ``.pub``, made
  with `capture.audit.signing_keys.keygen` when the stack has none, reused when it has. `infra.stack.env` hands
  its path to every command run against the stack (``REPROLANE_AUDIT_SIGNING_KEY``), so the checkpointer signs
  with it, and ``reprolane audit verify``, ``audit evidence export`` and the console's inclusion and "download evidence"
  use it without a flag. Its fingerprint is what a verifier pins (``audit evidence verify --key-fingerprint``).
- **Proof** (`wait_until_proved`): every envelope of the run verifies against a C2SP checkpoint the demo's
  checkpointer signed (`capture.audit.verify.verify_request`, the same check as ``reprolane audit verify``).
- **The lake** (`wait_until_archived`): every envelope and replay of the run is in the lake the demo's archiver
  writes (`capture.audit.lake.query.run_query`, the same views as ``reprolane audit query``).
- **What to type** (`auditor_commands`): the commands the demo prints, each one of those checks by hand.

Both waits poll (the checkpointer signs and the archiver flushes every few seconds) and give up after their
timeout with what they found, which the demo prints: a record that did not prove itself is shown, not hidden.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from capture.audit.errors import AuditError
from capture.audit.lake.query import QueryError, run_query
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.audit.settings import AuditSettings
from capture.audit.signing_keys import keygen, load_private, public_of
from capture.audit.store import AuditStore
from capture.audit.verify import verify_request
from infra.stack.env import AUDIT_SIGNING_KEY_FILE, stack_defaults
from infra.stack.state import StackInfo
from schemas.note import key_fingerprint

#: How often the demo's checkpointer signs and its archiver writes the lake (seconds).
CHECKPOINT_EVERY_S = 2.0
ARCHIVER_FLUSH_S = 2.0


@dataclass(frozen=True)
class AuditKey:
    """The stack's audit signing key: where it is, its public key file, its fingerprint, whether made now."""

    path: Path
    public_path: Path
    public_raw: bytes
    made: bool

    @property
    def fingerprint(self) -> str:
        """``sha256:HEX`` of the public key, as ``reprolane audit evidence key`` prints it."""
        return key_fingerprint(self.public_raw)


def ensure_audit_key(run_dir: Path) -> AuditKey:
    """``<run dir>/audit-signing.pem``, made when missing (0600, `keygen`); `SigningKeyError` when the one there
    cannot be used (unreadable, or readable by others: the checkpointer would refuse it too)."""
    path = run_dir / AUDIT_SIGNING_KEY_FILE
    made = not path.is_file()
    if made:
        keygen(path)
    public_path = path.with_name(path.name + ".pub")
    private = load_private(str(path))
    if not public_path.is_file():  # a key made by hand without its .pub: the fingerprint is still the key's
        public_path = path
    return AuditKey(path, public_path, public_of(private), made)


def _settings_env(info: StackInfo, prefix: str) -> dict[str, str]:
    """The stack's defaults for one service's settings, as init arguments (they win over this process's env)."""
    return {k.removeprefix(prefix).lower(): v for k, v in stack_defaults(info).items() if k.startswith(prefix)}


def audit_store(info: StackInfo) -> AuditStore:
    return AuditStore.from_settings(AuditSettings(**_settings_env(info, "REPROLANE_AUDIT_")))  # type: ignore[arg-type]


def lake(info: StackInfo) -> Lake:
    return Lake.from_settings(LakeSettings(**_settings_env(info, "REPROLANE_ARCHIVER_")))  # type: ignore[arg-type]


def wait_until_proved(store: AuditStore, request_ids: Collection[str], public_raw: bytes, timeout_s: float) -> int:
    """How many of `request_ids` verify (inclusion against a signed checkpoint) once all do or `timeout_s`
    passed; a request is checked until it verifies once."""
    pending = set(request_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        for rid in sorted(pending):
            try:
                if verify_request(store, rid, public_raw).ok:
                    pending.discard(rid)
            except AuditError:
                pass  # not in the index yet, or the store failed: asked again next round
        if not pending or time.monotonic() > deadline:
            return len(request_ids) - len(pending)
        time.sleep(1.0)


def _quoted(ids: Collection[str]) -> str:
    return ", ".join("'" + i.replace("'", "''") + "'" for i in sorted(ids))


def archived(lake_: Lake, request_ids: Collection[str]) -> tuple[int, int]:
    """(envelopes, replays) of `request_ids` in the lake, each id counted once."""
    if not request_ids:
        return 0, 0
    ids = _quoted(request_ids)
    sql = (
        f"SELECT (SELECT count(DISTINCT request_id) FROM envelopes WHERE request_id IN ({ids})),"
        f" (SELECT count(DISTINCT request_id) FROM divergences WHERE request_id IN ({ids}))"
    )
    try:
        (row,) = run_query(lake_, sql).rows
    except (QueryError, AuditError):  # no partition written yet reads as an error: nothing archived
        return 0, 0
    return int(row[0]), int(row[1])


def wait_until_archived(lake_: Lake, envelopes: Collection[str], replayed: Collection[str],
                        timeout_s: float) -> tuple[int, int]:  # fmt: skip
    """(envelopes, replays) of the run in the lake once all are there or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = archived(lake_, envelopes)
        done = found[0] >= len(envelopes) and found[1] >= len(replayed)
        if done or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


def auditor_commands(request_id: str, key: AuditKey, since: str) -> list[str]:
    """The commands an auditor types after the demo (each one answers from the stack alone): prove the record,
    export its evidence and check it offline against the pinned fingerprint, find the run in the lake."""
    bundle = f"evidence-{request_id}.zip"
    return [
        f"reprolane audit verify {request_id}",
        f"reprolane audit evidence export {request_id} -o {bundle}",
        f"reprolane audit evidence verify {bundle} --key-fingerprint {key.fingerprint}",
        'reprolane audit query "SELECT tenant, count(*) AS requests FROM envelopes WHERE captured_at >= '
        f"'{since}' GROUP BY tenant ORDER BY tenant\"",
    ]
