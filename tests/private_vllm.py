"""Private vLLM servers for the stack tests whose engine must differ from the session stack's, each stopped by its
process group at the end. About 750 MB and half a minute to a minute of start-up on this machine kind: one per test
module at most.

- `launched_vllm`: started by the stack's own launcher (`infra.stack.launcher`, the schedule recorder included) with
  the stack's flags plus the test's (a token budget per step, LoRA, a model copy with its own defaults). A module
  that sends nothing to the session stack's vLLM is marked ``own_engines`` and may run beside the stack group under
  xdist (tests/conftest.py).
- `candidate_vllm`: a shadow candidate beside the stack's vLLM: the same model and command with another dtype and no
  prefix cache, on a free port, with the runtime file that declares them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.errors import StackError
from infra.stack import process, servers
from infra.stack.launcher import LocalStack
from infra.stack.ports import allocate_ports
from infra.stack.servers import VLLM_RUNTIME
from infra.stack.state import StackInfo


@contextlib.contextmanager
def launched_vllm(run_dir: Path, extra_args: Sequence[str] = (), *, cache_dir: Path | None = None) -> Iterator[str]:
    """Start a vLLM alone in `run_dir` (the model from `cache_dir` when given), its argv the stack's plus
    `extra_args`; yield its URL once ready; stop it by its process group at the end."""
    launch = servers.VllmServer.launch

    def with_extra(self: servers.VllmServer, state: Any, ports: Any) -> servers.Launch:
        out = launch(self, state, ports)
        return dataclasses.replace(out, argv=[*out.argv, *extra_args])

    private = LocalStack(run_dir, cache_dir=cache_dir, kafka_storage="memory")
    try:
        # patched for this launch only; up() started vLLM, then found no S3/Kafka to describe
        with pytest.MonkeyPatch.context() as patch, contextlib.suppress(StackError):
            patch.setattr(servers.VllmServer, "launch", with_extra)
            private.up(["vllm"])
        (status,) = private.status()
        assert status.health == "ready", status.log_tail
        assert status.url is not None
        yield status.url
    finally:
        private.down()


@dataclasses.dataclass(frozen=True)
class PrivateVllm:
    """A running `candidate_vllm`: where it answers, its process (a test may stop or kill it), what it declares."""

    url: str
    ref: process.ProcessRef
    runtime_file: Path  # its declared RuntimeFingerprint fields (the dtype it was started with, ...)
    log: Path


@contextlib.contextmanager
def candidate_vllm(
    stack: StackInfo, run_dir: Path, *, dtype: str, max_num_seqs: int = 8, ready_timeout_s: float = 600.0
) -> Iterator[PrivateVllm]:
    """vLLM CPU serving the stack's model as ``stack.model_name`` with `dtype` (eager, no prefix cache)."""
    assert stack.model_dir is not None
    (port,) = allocate_ports(1)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(stack.model_dir),
        "--served-model-name", stack.model_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--max-model-len", "2048", "--enforce-eager", "--max-num-seqs", str(max_num_seqs),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}  # fmt: skip
    runtime = {**VLLM_RUNTIME, "dtype": dtype, "max_num_seqs": max_num_seqs, "prefix_caching": False,
               "torch_version": version("torch")}  # fmt: skip
    runtime_file = run_dir / f"vllm-{dtype}-runtime.json"
    runtime_file.write_text(json.dumps(runtime))
    log = run_dir / f"vllm-{dtype}.log"
    ref = process.spawn(argv, env, log, run_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert process.is_alive(ref), f"the private vLLM exited:\n{log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"the private vLLM did not start:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                    break
            time.sleep(1.0)
        yield PrivateVllm(url, ref, runtime_file, log)
    finally:
        process.stop(ref, timeout_s=30.0)
