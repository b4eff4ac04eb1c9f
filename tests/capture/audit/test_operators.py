"""Operator authorisation (`capture.audit.operators`): the key store, roles, tenant scope, and the access log,
against moto's S3; ``reprolane keys operator`` through the real command line."""

from __future__ import annotations

import stat
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr
from typer.testing import CliRunner

from capture.audit.errors import AccessDenied, AuditStoreError
from capture.audit.operators import OPERATOR_KEYS, OperatorGate, OperatorSettings
from capture.audit.store import AuditStore
from capture.ledger.key_file import load_key_file, new_key, write_key_file
from capture.request.auth import new_key as new_api_key
from infra.cli.root import build_app
from schemas.access_log import AccessRecord, decode_access_record
from schemas.layout import ACCESS_LOG_PREFIX
from tests.moto_s3 import moto_client


@pytest.fixture
def store(moto_store: AuditStore) -> AuditStore:
    return moto_store


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A key store with an unscoped hold-admin, a hold-admin of tenant acme, a viewer; a 0600 file per key."""
    entries, files = [], {}
    for key_id, roles, tenant in (("admin", ["hold-admin"], None), ("acme", ["hold-admin"], "acme"),
                                  ("view", ["viewer"], None)):  # fmt: skip
        key, entry = new_key(OPERATOR_KEYS, key_id, tenant, roles)
        entries.append(entry)
        files[key_id] = tmp_path / f"{key_id}.key"
        files[key_id].write_text(key + "\n")
        files[key_id].chmod(0o600)
    files["store"] = tmp_path / "operators.json"
    write_key_file(files["store"], entries)
    return files


def records(store: AuditStore) -> list[AccessRecord]:
    found = [decode_access_record(store.get(key) or b"") for key, _ in store.list_keys(ACCESS_LOG_PREFIX)]
    return sorted(found, key=lambda r: r.at)


def gate(store: AuditStore, keys: dict[str, Path], who: str | None) -> OperatorGate:
    settings = OperatorSettings(keys_path=keys["store"])
    return OperatorGate(store, settings, keys[who] if who is not None else None)


def test_the_right_role_in_scope_is_allowed_and_logged_before_acting(store: AuditStore, keys: dict[str, Path]) -> None:
    op = gate(store, keys, "admin").authorise("hold.add", "req-1", "globex")
    assert (op.key_id, op.tenant) == ("admin", None)
    assert gate(store, keys, "acme").authorise("hold.remove", "wf-9", "acme").key_id == "acme"
    got = records(store)
    assert [(r.actor_key_id, r.role, r.action, r.target, r.tenant, r.result, r.reason) for r in got] == [
        ("admin", "hold-admin", "hold.add", "req-1", "globex", "allowed", None),
        ("acme", "hold-admin", "hold.remove", "wf-9", "acme", "allowed", None),
    ]
    assert all(r.at.tzinfo is not None for r in got)


def test_one_role_rule_a_hold_admin_may_view_a_viewer_may_not_hold(store: AuditStore, keys: dict[str, Path]) -> None:
    """The CLI's gate asks `schemas.access_log.role_grants`, as the console's sessions do: a hold-admin may read
    (the console's view actions), a viewer may not place a hold, neither may expire."""
    assert gate(store, keys, "admin").authorise("view.request", "req-1", None).key_id == "admin"
    assert gate(store, keys, "acme").authorise("evidence.download", "req-2", "acme").may("viewer")
    with pytest.raises(AccessDenied, match="lacks the 'retention-admin' role"):
        gate(store, keys, "admin").authorise("expire", "2026-01-01", None)
    got = records(store)
    assert [(r.action, r.role, r.result, r.peer) for r in got] == [
        ("view.request", "viewer", "allowed", None),
        ("evidence.download", "viewer", "allowed", None),
        ("expire", "retention-admin", "refused", None),
    ]


@pytest.mark.parametrize(
    ("who", "action", "tenant", "why"),
    [
        (None, "hold.add", "acme", "no operator key: pass --operator-key-file"),
        ("view", "hold.add", "acme", "operator key 'view' lacks the 'hold-admin' role"),
        ("admin", "keys.shred", "acme", "operator key 'admin' lacks the 'key-admin' role"),
        ("acme", "hold.add", "globex", "operator key 'acme' is scoped to tenant 'acme', not tenant 'globex'"),
        ("acme", "hold.add", None, "operator key 'acme' is scoped to tenant 'acme', not every tenant"),
    ],
)
def test_refusals_are_logged_and_raised(
    store: AuditStore, keys: dict[str, Path], who: str | None, action: str, tenant: str | None, why: str
) -> None:
    with pytest.raises(AccessDenied, match=f"^{action} refused: ") as refused:
        gate(store, keys, who).authorise(action, "target-1", tenant)  # type: ignore[arg-type]
    assert why in str(refused.value)
    [record] = records(store)
    assert (record.result, record.action, record.tenant) == ("refused", action, tenant)
    assert record.reason is not None
    assert why in record.reason
    assert record.actor_key_id == (None if who is None else who)


def test_unknown_keys_another_kinds_key_and_no_store_are_refused(
    store: AuditStore, keys: dict[str, Path], tmp_path: Path
) -> None:
    forged = tmp_path / "forged.key"
    forged.write_text(keys["admin"].read_text()[:-6] + "AAAAA\n")  # the right id, another secret
    forged.chmod(0o600)
    api_key, _ = new_api_key("admin", "acme", ("capture", "flag"))  # a sidecar API key is no operator key
    for settings, key_file in (
        (OperatorSettings(keys_path=keys["store"]), forged),
        (OperatorSettings(keys_path=keys["store"], key=SecretStr(api_key)), None),
        (OperatorSettings(key_file=keys["admin"]), None),
    ):
        with pytest.raises(AccessDenied):
            OperatorGate(store, settings, key_file).authorise("hold.add", "r", "acme")
    reasons = [r.reason for r in records(store)]
    assert reasons[:2] == ["the operator key is not in the key store (unknown, revoked or mistyped)"] * 2
    assert reasons[2] == "no operator key store is configured (REPROLANE_OPERATOR_KEYS_PATH)"
    assert all(r.actor_key_id is None for r in records(store))
    # the key itself (from the environment) proves itself too
    settings = OperatorSettings(keys_path=keys["store"], key=SecretStr(keys["admin"].read_text()))
    assert OperatorGate(store, settings).authorise("hold.add", "r", "acme").key_id == "admin"


def test_a_key_file_others_can_read_is_refused(store: AuditStore, keys: dict[str, Path]) -> None:
    keys["admin"].chmod(0o644)
    with pytest.raises(AccessDenied, match="readable or writable by group or others"):
        gate(store, keys, "admin").authorise("hold.add", "r", "acme")
    keys["admin"].chmod(0o640)  # a token, not a hash: its group may not read it either
    with pytest.raises(AccessDenied, match="readable or writable by group or others"):
        gate(store, keys, "admin").authorise("hold.add", "r", "acme")
    keys["admin"].chmod(0o600)
    keys["store"].chmod(0o666)
    with pytest.raises(AccessDenied, match=r"REPROLANE_OPERATOR_KEYS_PATH: .* readable by others"):
        gate(store, keys, "admin").authorise("hold.add", "r", "acme")


def test_scope_fills_in_the_keys_tenant_and_refuses_another_before_anything_is_read(
    store: AuditStore, keys: dict[str, Path]
) -> None:
    assert gate(store, keys, "acme").scope("hold.add", "wf", None) == "acme"
    assert gate(store, keys, "admin").scope("hold.add", "wf", None) is None
    assert records(store) == []  # deciding the scope logs nothing by itself
    with pytest.raises(AccessDenied, match="scoped to tenant 'acme'"):
        gate(store, keys, "acme").scope("hold.add", "wf", "globex")
    assert [r.result for r in records(store)] == ["refused"]


def test_no_action_is_taken_when_its_record_cannot_be_written(keys: dict[str, Path], moto_endpoint: str) -> None:
    missing = AuditStore(moto_client(moto_endpoint), f"no-bucket-{uuid.uuid4().hex[:8]}")
    with pytest.raises(AuditStoreError, match="NoSuchBucket"):
        gate(missing, keys, "admin").authorise("hold.add", "r", "acme")
    with pytest.raises(AccessDenied, match=r"lacks the 'hold-admin' role \(and its access record was not written"):
        gate(missing, keys, "view").authorise("hold.add", "r", "acme")


def test_add_key_mints_a_hashed_entry_and_a_private_key_file(tmp_path: Path) -> None:
    store_file, key_out = tmp_path / "ops" / "operators.json", tmp_path / "ops" / "shred.key"
    app = build_app()
    args = ["keys", "operator", str(store_file), "--id", "shredder", "--role", "key-admin", "--tenant", "acme"]
    done = CliRunner().invoke(app, [*args, "--key-output", str(key_out)])
    assert done.exit_code == 0, done.output
    key = key_out.read_text().strip()
    assert key.startswith("rlo_shredder_")
    assert key not in store_file.read_text()  # hashed, never stored
    assert stat.S_IMODE(store_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_out.stat().st_mode) == 0o600
    [entry] = load_key_file(store_file, OPERATOR_KEYS, field="f").values()
    assert (entry.key_id, entry.tenant, entry.roles) == ("shredder", "acme", frozenset({"key-admin"}))
    printed = CliRunner().invoke(app, ["keys", "operator", str(store_file), "--id", "all", "--role", "viewer"])
    assert printed.exit_code == 0
    assert printed.stdout.startswith("rlo_all_")
    assert load_key_file(store_file, OPERATOR_KEYS, field="f")["all"].tenant is None
    for bad, why in (
        ([*args], "--id 'shredder' is already in"),
        (["keys", "operator", str(store_file), "--id", "x", "--role", "root"], "roles must be of"),
    ):
        refused = CliRunner().invoke(app, bad)
        assert (refused.exit_code, refused.stderr.count("\n")) == (2, 1), refused.output
        assert why in refused.stderr
