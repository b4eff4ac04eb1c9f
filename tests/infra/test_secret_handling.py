"""Secrets stay private on disk and out of process environments (issue 18, findings 7 and 10).

- ``stack.json`` and ``s3_secret_key`` are written 0600 in a 0700 run dir, whatever the umask;
- the stack's defaults hand the S3 secret to the services as a file (``REPROLANE_*_S3_SECRET_KEY_FILE``),
  never as a value in this process's environment or a child's, and the settings read it from there;
- the settings refuse the committed example values, naming the field and the file;
- a checkpoint signing key that its group or others may read is refused, naming the path and the mode;
- a key file (`infra.clients.connection.read_private_file`) only its owner may change, and read unless it holds
  hashes only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from capture.audit.errors import SigningKeyError
from capture.audit.settings import AuditSettings
from capture.audit.signing_keys import keygen, load_private, signing_key
from capture.settings import CaptureSettings
from infra.clients.connection import read_private_file
from infra.stack.buckets import S3Credentials
from infra.stack.env import apply_stack_defaults
from infra.stack.state import ServerRecord, StackState
from replayer.settings import ReplayerSettings

SECRET = "0123456789abcdef0123456789abcdef"
STATE_FILE, S3_SECRET_FILE = (
    "stack.json",
    "s3_secret_key",
)  # infra.stack.state's names, spelled out: a test of the layout


@pytest.fixture
def loose_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def saved_state(run_dir: Path) -> StackState:
    servers = {
        name: ServerRecord(name=name, ports={"p": port}, url=url, log=run_dir / f"{name}.log", pid_file=run_dir / "p")
        for name, port, url in (("s3", 1, "http://127.0.0.1:1"), ("kafka", 2, "127.0.0.1:2"))
    }
    state = StackState(
        run_dir=run_dir,
        created_at=datetime.now(UTC),
        credentials=S3Credentials(access_key="reprolane", secret_key=SECRET),
        audit_bucket="reprolane-audit",
        tansu_bucket="reprolane-tansu",
        kafka_storage="memory",
        model_name="m",
        model_dir=None,
        servers=servers,  # type: ignore[arg-type]
    )
    state.save()
    return state


def test_the_state_file_and_the_secret_are_the_owners_alone(tmp_path: Path, loose_umask: None) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    saved_state(run_dir)
    assert run_dir.stat().st_mode & 0o777 == 0o700
    for name in (STATE_FILE, S3_SECRET_FILE):
        assert (run_dir / name).stat().st_mode & 0o777 == 0o600, name
    assert (run_dir / S3_SECRET_FILE).read_text(encoding="utf-8") == SECRET
    # saving again (stop/start) keeps them private
    (run_dir / STATE_FILE).chmod(0o644)
    StackState.load(run_dir).save()
    assert (run_dir / STATE_FILE).stat().st_mode & 0o777 == 0o600


def test_the_stack_hands_its_s3_secret_over_as_a_file(tmp_path: Path) -> None:
    saved_state(tmp_path)
    environ: dict[str, str] = {}
    assert apply_stack_defaults(environ, tmp_path) is not None
    assert not any(SECRET in value for value in environ.values()), "the S3 secret is in the environment"
    assert environ["REPROLANE_CAPTURE_S3_SECRET_KEY_FILE"] == str(tmp_path / S3_SECRET_FILE)
    for prefix, cls in (("REPROLANE_AUDIT_", AuditSettings), ("REPROLANE_REPLAYER_", ReplayerSettings)):
        fields = {k.removeprefix(prefix).lower(): v for k, v in environ.items() if k.startswith(prefix)}
        settings = cls(**fields)
        assert settings.s3_secret_key is not None
        assert settings.s3_secret_key.get_secret_value() == SECRET
    # a value set explicitly still wins over the stack's file
    capture = CaptureSettings(upstream="http://u", s3_secret_key="mine", s3_secret_key_file=tmp_path / S3_SECRET_FILE)
    assert capture.s3_secret_key is not None
    assert capture.s3_secret_key.get_secret_value() == "mine"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("s3_secret_key", "LOCAL-ONLY-change-me-writer-secret"),
        ("kafka_sasl_password", "LOCAL-ONLY-change-me-kafka-capture"),
        ("kek", "TE9DQUwtT05MWS1jaGFuZ2UtbWUta2VrLTAwMDAwMCE="),
    ],
)
def test_settings_refuse_example_values(field: str, value: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"{field} is the committed example value: change its value"):
        CaptureSettings(upstream="http://u", **{field: value})  # type: ignore[arg-type]
    secret_file = tmp_path / "secret"
    secret_file.write_text(value + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{field} is the committed example value: change the file {secret_file}"):
        ReplayerSettings(**{f"{field}_file": secret_file})  # type: ignore[arg-type]


def test_settings_error_never_echoes_a_secret() -> None:
    with pytest.raises(ValueError, match="needs kafka_sasl_username") as info:
        CaptureSettings(
            upstream="http://u",
            kafka_bootstrap="k:9092",
            kafka_security_protocol="SASL_SSL",
            s3_secret_key="a-real-secret-value",
        )
    assert "a-real-secret-value" not in str(info.value)


def test_an_empty_secret_file_means_unset(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n", encoding="utf-8")
    assert CaptureSettings(upstream="http://u", kafka_sasl_password_file=empty).kafka_sasl_password is None
    with pytest.raises(ValueError, match="kafka_sasl_password_file: cannot read"):
        CaptureSettings(upstream="http://u", kafka_sasl_password_file=tmp_path / "missing")


def test_a_signing_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    private = tmp_path / "audit-signing.pem"
    keygen(private)
    assert len(load_private(str(private))) == 32  # as keygen wrote it: 0600
    for mode in (0o640, 0o604, 0o644):
        private.chmod(mode)
        with pytest.raises(SigningKeyError) as info:
            signing_key(AuditSettings(signing_key=str(private)))
        assert str(info.value) == (
            f"signing key {private}: mode {mode:04o} lets its group or others read it; "
            f"make it the owner's alone: chmod 600 {private}"
        )


@pytest.mark.parametrize(
    ("mode", "group_may_read", "refused"),
    [
        (0o600, False, False),
        (0o640, True, False),  # a file of hashes: its group may read it
        (0o640, False, True),  # a file of secrets: its owner's alone
        (0o620, True, True),
        (0o604, True, True),
        (0o602, True, True),
    ],
)
def test_a_key_file_anyone_but_its_owner_may_change_is_refused(
    tmp_path: Path, mode: int, group_may_read: bool, refused: bool
) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(b"the secret")
    path.chmod(mode)
    if not refused:
        assert read_private_file(path, "keys_path", group_may_read=group_may_read) == b"the secret"
        return
    with pytest.raises(ValueError, match=rf"^keys_path: {path} is .* \(mode {mode:04o}\): chmod 600 it$") as info:
        read_private_file(path, "keys_path", group_may_read=group_may_read)
    assert "the secret" not in str(info.value)


def test_a_key_file_that_cannot_be_read_is_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"^keys_path: cannot read {tmp_path / 'missing'}: "):
        read_private_file(tmp_path / "missing", "keys_path")
