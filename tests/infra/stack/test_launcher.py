"""The order in which `LocalStack.up` starts its servers, without starting any (the servers themselves:
test_stack_integration.py): vLLM, whose start is the slow one and needs no other server, is spawned before anything
is waited for; Kafka, which stores in S3, only once S3 and its buckets are ready."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest

from infra.stack import launcher
from infra.stack.launcher import LocalStack
from infra.stack.state import KafkaStorage


def steps_of_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, storage: KafkaStorage) -> list[str]:
    """What `up` did, in order: ``spawn NAME``, ``ready NAME``, ``buckets``, ``topics``."""
    steps: list[str] = []
    state = MagicMock()

    def spawn(self: LocalStack, st: Any, name: str) -> Any:
        if f"spawn {name}" not in steps:  # a second call finds it alive: nothing happens
            steps.append(f"spawn {name}")
        return st

    def ready(self: LocalStack, st: Any, name: str) -> Any:
        spawn(self, st, name)
        steps.append(f"ready {name}")
        return st

    monkeypatch.setattr(LocalStack, "_prepare_state", lambda self, wanted: state)
    monkeypatch.setattr(LocalStack, "_launch_unless_alive", spawn)
    monkeypatch.setattr(LocalStack, "_ensure_ready", ready)
    monkeypatch.setattr(launcher, "ensure_buckets", lambda *a: steps.append("buckets"))
    monkeypatch.setattr(launcher, "ensure_table_bucket", lambda *a: steps.append("table bucket"))
    monkeypatch.setattr(launcher, "ensure_topics", lambda *a: steps.append("topics") or [])
    LocalStack(tmp_path, kafka_storage=storage).up()
    return steps


def test_vllm_is_spawned_before_anything_is_waited_for_and_kafka_after_its_s3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = steps_of_up(tmp_path, monkeypatch, "s3")
    assert steps[:2] == ["spawn s3", "spawn vllm"]
    assert steps.index("spawn kafka") > steps.index("buckets") > steps.index("ready s3")
    assert steps.index("ready vllm") > steps.index("spawn kafka")  # Kafka's start overlaps with vLLM's too
    assert steps[-1] == "topics"


def test_kafka_in_memory_is_spawned_with_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    steps = steps_of_up(tmp_path, monkeypatch, "memory")
    assert steps[:3] == ["spawn s3", "spawn kafka", "spawn vllm"]
    assert not [step for step in steps[3:] if step.startswith("spawn")]  # every spawn before the first wait
