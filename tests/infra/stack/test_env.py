"""Stack defaults for the services' settings: the audit commands get the stack's S3 and signing key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from capture.audit.operators import OperatorGate, OperatorSettings
from capture.audit.settings import AuditSettings
from capture.settings import CaptureSettings
from infra.demo.services import write_console_logins
from infra.stack.env import AUDIT_SIGNING_KEY_FILE, apply_stack_defaults, operator_defaults, stack_defaults
from infra.stack.state import StackInfo
from tests.infra.test_secret_handling import saved_state


def info(run_dir: Path) -> StackInfo:
    return StackInfo(
        run_dir=run_dir,
        kafka_bootstrap="127.0.0.1:1",
        kafka_storage="memory",
        s3_endpoint="http://127.0.0.1:2",
        s3_access_key="ak",
        s3_secret_key="sk",
        s3_region="us-east-1",
        audit_bucket="reprolane-audit",
        tansu_bucket="reprolane-tansu",
        vllm_url=None,
        model_name="m",
        model_dir=None,
    )


def test_audit_settings_come_from_the_stack(tmp_path: Path) -> None:
    env = stack_defaults(info(tmp_path))
    assert env["REPROLANE_AUDIT_S3_ENDPOINT"] == "http://127.0.0.1:2"
    assert env["REPROLANE_AUDIT_S3_BUCKET"] == "reprolane-audit"
    assert env["REPROLANE_CAPTURE_AUDIT_LOG"] == "true"
    assert "REPROLANE_AUDIT_SIGNING_KEY" not in env  # no key made yet
    (tmp_path / AUDIT_SIGNING_KEY_FILE).write_text("x")
    env = stack_defaults(info(tmp_path))
    assert env["REPROLANE_AUDIT_SIGNING_KEY"] == str(tmp_path / AUDIT_SIGNING_KEY_FILE)
    audit = {k.removeprefix("REPROLANE_AUDIT_").lower(): v for k, v in env.items() if k.startswith("REPROLANE_AUDIT_")}
    assert AuditSettings(**audit).s3_access_key == "ak"  # every default is a real field
    capture = {
        k.removeprefix("REPROLANE_CAPTURE_").lower(): v for k, v in env.items() if k.startswith("REPROLANE_CAPTURE_")
    }
    assert CaptureSettings(upstream="http://u", **capture).audit_log is True


def test_the_operator_commands_find_a_demo_runs_operator_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``reprolane demo`` the hold commands act with the demo's hold-admin key without a flag: the key store
    and key file the demo itself wrote (`write_console_logins`) are this process's defaults, read by the real
    `OperatorSettings` and proved by the real `OperatorGate`; a key the caller set wins."""
    saved_state(tmp_path)  # a stack.json, as `reprolane stack up` writes it
    assert operator_defaults(tmp_path, {}) == {}  # no demo ran: nothing
    logins = write_console_logins(tmp_path / "demo")
    for name in list(os.environ):
        if name.startswith("REPROLANE_"):
            monkeypatch.delenv(name)
    environ: dict[str, str] = {}
    assert apply_stack_defaults(environ, tmp_path) is not None
    assert environ["REPROLANE_OPERATOR_KEYS_PATH"] == str(logins.keys_path)
    assert environ["REPROLANE_OPERATOR_KEY_FILE"] == str(logins.key_files["hold-admin"])
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    gate = OperatorGate(None, OperatorSettings())  # type: ignore[arg-type]  # identify writes nothing
    assert gate.identify("hold.add", "rl-x").key_id == "demo-hold-admin"
    own = {"REPROLANE_OPERATOR_KEY": "rlo_mine_x"}
    assert "REPROLANE_OPERATOR_KEY_FILE" not in operator_defaults(tmp_path, own)
    assert operator_defaults(tmp_path, own)["REPROLANE_OPERATOR_KEYS_PATH"] == str(logins.keys_path)
