"""The MinIO policies minio-init creates (infra/minio/init.sh), run with a stand-in ``mc``: the writer cannot
delete, and each operator role's policy allows exactly that role's state-changing S3 calls (docs/SECURITY.md,
"Operators"): S3 refuses what reprolane's operator-key check refuses, even to a client that skips it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

INIT = Path(__file__).resolve().parents[2] / "infra" / "minio" / "init.sh"
AUDIT, LAKE = "audit-b", "lake-b"


def run_init(tmp: Path) -> tuple[Path, list[str]]:
    """infra/minio/init.sh with a stand-in ``mc`` that copies each policy into ``tmp/policies`` and logs the file it
    was given, and ``TMPDIR`` inside `tmp`: (the copied policies, the files mc was given)."""
    secrets, out, tmpdir = tmp / "secrets", tmp / "policies", tmp / "tmpdir"
    for directory in (secrets, out, tmpdir):
        directory.mkdir()
    for name in ("minio_root_user", "minio_root_password", "s3_access_key", "s3_secret_key"):
        (secrets / name).write_text(f"{name}-value\n", encoding="utf-8")
    given = tmp / "given"
    mc = tmp / "mc"
    mc.write_text(
        "#!/bin/sh\n"
        f'case "$*" in\n'
        f'  "admin policy create local "*) cp "$6" "{out}/$5.json"; echo "$6" >> "{given}" ;;\n'
        '  "retention info"*) echo "Mode: COMPLIANCE" ;;\n'
        '  "admin user info"*) echo "PolicyName: reprolane-writer" ;;\n'
        "esac\nexit 0\n",
        encoding="utf-8",
    )
    mc.chmod(0o755)
    env = {"PATH": f"{tmp}:{os.environ['PATH']}", "SECRETS_DIR": str(secrets), "S3_BUCKET": AUDIT,
           "KEYS_BUCKET": LAKE, "TMPDIR": str(tmpdir)}  # fmt: skip
    subprocess.run(["sh", str(INIT)], env=env, check=True, capture_output=True)
    return out, given.read_text(encoding="utf-8").split()


@pytest.fixture(scope="module")
def policies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out, _ = run_init(tmp_path_factory.mktemp("minio"))
    return {p.stem: json.loads(p.read_text(encoding="utf-8"))["Statement"] for p in out.glob("*.json")}


def test_the_policy_files_are_written_in_a_directory_of_the_runs_own_and_removed(tmp_path: Path) -> None:
    """Not at fixed /tmp names, which another run overwrites while mc reads them (two test workers did: an empty
    policy) or where someone else planted a symlink."""
    _, given = run_init(tmp_path)
    assert len(given) == 5, given  # the writer's and the four roles'
    assert all(Path(f).is_relative_to(tmp_path / "tmpdir") for f in given), given
    assert list((tmp_path / "tmpdir").iterdir()) == []  # removed at exit


def allowed(statements: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(action, resource) for s in statements for action in s["Action"] for resource in s["Resource"]}


def actions(statements: list[dict[str, Any]]) -> set[str]:
    return {action for action, _ in allowed(statements)}


def test_every_role_has_a_policy_that_parses(policies: dict[str, list[dict[str, Any]]]) -> None:
    assert set(policies) == {f"reprolane-{r}" for r in ("writer", "viewer", "hold-admin", "retention-admin",
                                                          "key-admin")}  # fmt: skip


def test_each_state_change_is_allowed_to_its_role_only(policies: dict[str, list[dict[str, Any]]]) -> None:
    owners: dict[str, set[str]] = {}
    for name, statements in policies.items():
        for action in actions(statements):
            owners.setdefault(action, set()).add(name.removeprefix("reprolane-"))
    assert owners["s3:PutObjectLegalHold"] == {"hold-admin"}
    assert owners["s3:DeleteObjectVersion"] == {"retention-admin", "key-admin"}
    assert owners["s3:DeleteObject"] == {"key-admin"}
    assert ("s3:DeleteObjectVersion", f"arn:aws:s3:::{AUDIT}/envelopes/*") in allowed(
        policies["reprolane-retention-admin"]
    )
    assert ("s3:DeleteObjectVersion", f"arn:aws:s3:::{LAKE}/keys/*") in allowed(policies["reprolane-key-admin"])
    assert not any("Delete" in a for a in actions(policies["reprolane-writer"]))
    assert not any("Delete" in a or "LegalHold" in a for a in actions(policies["reprolane-viewer"]))


def test_every_operator_role_may_write_the_access_log_and_nothing_else_of_the_audit_records(
    policies: dict[str, list[dict[str, Any]]],
) -> None:
    for role in ("viewer", "hold-admin", "retention-admin", "key-admin"):
        puts = {r for a, r in allowed(policies[f"reprolane-{role}"]) if a == "s3:PutObject"}
        assert f"arn:aws:s3:::{AUDIT}/audit/access/*" in puts
        assert f"arn:aws:s3:::{AUDIT}/*" not in puts
        assert not any(r.endswith("/envelopes/*") for r in puts)
