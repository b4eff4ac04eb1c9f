"""A private vLLM for the stack tests whose engine must differ from the session stack's (a token budget per step,
LoRA, a model copy with its own defaults), launched by the stack's own launcher (`infra.stack.launcher`) with the
stack's flags plus the test's. Such a module sends nothing to the session stack's vLLM, so it is marked
``own_engines`` and may run beside the stack group under xdist (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from infra.errors import StackError
from infra.stack import servers
from infra.stack.launcher import LocalStack


@contextlib.contextmanager
def private_vllm(run_dir: Path, extra_args: Sequence[str] = (), *, cache_dir: Path | None = None) -> Iterator[str]:
    """Start a vLLM alone in `run_dir` (the model from `cache_dir` when given), its argv the stack's plus
    `extra_args`; yield its URL once ready; stop it by its process group at the end."""
    patch = pytest.MonkeyPatch()
    launch = servers.VllmServer.launch

    def with_extra(self: servers.VllmServer, state: Any, ports: Any) -> servers.Launch:
        out = launch(self, state, ports)
        return dataclasses.replace(out, argv=[*out.argv, *extra_args])

    patch.setattr(servers.VllmServer, "launch", with_extra)
    private = LocalStack(run_dir, cache_dir=cache_dir, kafka_storage="memory")
    try:
        with contextlib.suppress(StackError):  # up() started vLLM, then found no S3/Kafka to describe
            private.up(["vllm"])
        (status,) = private.status()
        assert status.health == "ready", status.log_tail
        assert status.url is not None
        yield status.url
    finally:
        private.down()
        patch.undo()
