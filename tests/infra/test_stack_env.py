"""Stack defaults for the services' settings: the audit commands get the stack's S3 and signing key."""

from __future__ import annotations

from pathlib import Path

from capture.audit.settings import AuditSettings
from capture.settings import CaptureSettings
from infra.stack_env import AUDIT_SIGNING_KEY_FILE, stack_defaults
from infra.state import StackInfo


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
