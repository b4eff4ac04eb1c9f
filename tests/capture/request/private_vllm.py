"""A second, private vLLM server for tests that need a candidate beside the stack's: the same model folder and
command as the stack's (`infra.stack.servers.VllmServer`) with other flags (a dtype, a scheduling limit), on a free
port, stopped by its process group at the end. About 750 MB and a minute of start-up on this machine kind: one
per test module at most."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx

from infra.stack import process
from infra.stack.ports import allocate_ports
from infra.stack.servers import VLLM_RUNTIME
from infra.stack.state import StackInfo


@dataclass(frozen=True)
class PrivateVllm:
    url: str
    ref: process.ProcessRef
    runtime_file: Path  # its declared RuntimeFingerprint fields (the dtype it was started with, ...)
    log: Path


@contextlib.contextmanager
def private_vllm(
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
