"""stack.json round trip and the errors for a missing or broken state file."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from infra.errors import StackError, StackNotRunningError
from infra.stack.buckets import S3Credentials
from infra.stack.state import STATE_FILE, ServerRecord, StackInfo, StackState


def _state(run_dir: Path) -> StackState:
    def record(name: str, ports: dict[str, int], url: str, pid: int | None) -> ServerRecord:
        return ServerRecord.model_validate(
            {"name": name, "ports": ports, "url": url, "log": run_dir / f"{name}.log",
             "pid_file": run_dir / f"{name}.pid", "pid": pid, "start_ticks": None if pid is None else 42}
        )  # fmt: skip

    return StackState(
        run_dir=run_dir,
        created_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        credentials=S3Credentials(access_key="k", secret_key="s"),
        audit_bucket="audit",
        tansu_bucket="tansu",
        kafka_storage="s3",
        model_name="m",
        model_dir=None,
        servers={
            "s3": record("s3", {"s3": 12000, "master": 12001}, "http://127.0.0.1:12000", 100),
            "kafka": record("kafka", {"kafka": 13000}, "127.0.0.1:13000", None),
        },
    )


def test_state_round_trips_and_info_reads_back(tmp_path: Path) -> None:
    state = _state(tmp_path)
    state.save()
    assert StackState.load(tmp_path) == state
    info = StackInfo.load(tmp_path)
    assert info.kafka_bootstrap == "127.0.0.1:13000"
    assert info.s3_endpoint == "http://127.0.0.1:12000"
    assert info.s3_credentials == S3Credentials(access_key="k", secret_key="s", region="us-east-1")
    assert info.vllm_url is None
    assert state.servers["s3"].process is not None
    assert state.servers["kafka"].process is None


def test_missing_state_says_stack_not_running(tmp_path: Path) -> None:
    with pytest.raises(StackNotRunningError, match="reprolane stack up"):
        StackState.load(tmp_path)
    assert StackState.load_or_none(tmp_path) is None


def test_broken_state_is_a_stack_error(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text('{"state_version": 1}')
    with pytest.raises(StackError, match="unreadable state"):
        StackState.load(tmp_path)
