"""The local stack's vLLM records its schedule when reprolane's recorder is installed (issue 22): the flag, the
directory, and the defaults that make the sidecar and the shipper follow; nothing of it when it is not."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from capture.schedule.shipper_settings import ShipperSettings
from capture.settings import CaptureSettings
from infra.stack import servers
from infra.stack.buckets import S3Credentials
from infra.stack.env import stack_defaults
from infra.stack.state import StackState
from tests.infra.stack.test_env import info


def _launch(run_dir: Path) -> servers.Launch:
    state = StackState(
        run_dir=run_dir, created_at=datetime.now(UTC), credentials=S3Credentials(access_key="a", secret_key="s"),
        audit_bucket="a", tansu_bucket="t", kafka_storage="memory", model_name="m", model_dir=run_dir / "model",
        servers={},
    )  # fmt: skip
    return servers.SERVERS["vllm"].launch(state, {"http": 1})


def test_vllm_records_its_schedule_when_the_recorder_is_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launch = _launch(tmp_path)  # the real recorder (capture.schedule.recorder) is importable
    flag = launch.argv.index("--scheduler-cls")
    assert launch.argv[flag + 1] == "capture.schedule.recorder.RecordingScheduler"
    assert launch.env[servers.SCHEDULE_DIR_ENV] == str(tmp_path / "schedules")
    assert (tmp_path / "schedules").is_dir()

    env = stack_defaults(info(tmp_path))
    assert env["REPROLANE_CAPTURE_SCHEDULE_RECORDER"] == servers.RECORDER_NAME
    capture = {
        k.removeprefix("REPROLANE_CAPTURE_").lower(): v for k, v in env.items() if k.startswith("REPROLANE_CAPTURE_")
    }
    assert CaptureSettings(upstream="http://u", **capture).schedule_recorder == servers.RECORDER_NAME
    shipper = {
        k.removeprefix("REPROLANE_SHIPPER_").lower(): v for k, v in env.items() if k.startswith("REPROLANE_SHIPPER_")
    }
    settings = ShipperSettings(**shipper)
    assert settings.schedule_dir == tmp_path / "schedules"
    assert settings.s3_access_key == "ak"
    assert settings.quarantine == tmp_path / "schedules.quarantine"


def test_no_flag_and_no_defaults_without_the_recorder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _launch(tmp_path)  # a stack that recorded once ...
    monkeypatch.setattr(servers, "RECORDER_CLASS", "capture.no_such_module.RecordingScheduler")
    launch = _launch(tmp_path)  # ... and is started again without the recorder
    assert "--scheduler-cls" not in launch.argv
    assert not (tmp_path / servers.SCHEDULE_FILE).exists()
    env = stack_defaults(info(tmp_path))
    assert "REPROLANE_CAPTURE_SCHEDULE_RECORDER" not in env
    assert "REPROLANE_SHIPPER_SCHEDULE_DIR" not in env


def test_the_recorder_class_is_the_engines_module() -> None:
    """The flag names the recorder of `capture.schedule` (written beside the shipper)."""
    assert servers.RECORDER_CLASS == "capture.schedule.recorder.RecordingScheduler"
