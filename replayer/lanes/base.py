"""The lane interface: one execution environment that re-runs a recorded request.

A lane takes the recorded prompt token ids and sampling contract and returns what it generated, with
per-step top-k logprobs, plus the `schemas.RuntimeFingerprint` of itself (so a replay can name which
environment fields differ from the capture). Lanes are blocking; the service runs them in a worker thread
and never runs two replays on one lane at once (a lane is a fixed schedule: one sequence at a time).

Heavy imports (torch, vllm, transformers) live in the lane modules, inside functions only.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

from replayer.errors import LaneUnavailableError
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint, SamplingContract

DEFAULT_MODEL_SUBDIR = "models/smollm2-135m-instruct"

#: Wheels that bring cuBLAS with torch (CUDA 13, CUDA 12, unsuffixed), first installed wins.
CUBLAS_DISTS = ("nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas")


@runtime_checkable
class Lane(Protocol):
    """An execution lane. Implementations: `VllmLane`, `RemoteLane`, `TransformersLane`."""

    name: str

    def fingerprint(self) -> RuntimeFingerprint:
        """The runtime fingerprint of this lane (stable for the lane's lifetime)."""
        ...

    def replay(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingContract,
        *,
        max_tokens: int,
        top_k_logprobs: int,
    ) -> ReplayedOutput:
        """Generate from the prompt ids under the contract; blocking. ``max_tokens`` overrides the contract's."""
        ...

    def close(self) -> None:
        """Release the engine (idempotent)."""
        ...


def resolve_model_dir(settings: ReplayerSettings) -> Path:
    """The model folder: ``settings.model_dir`` or the cache that ``reprolane model fetch`` fills."""
    if settings.model_dir is not None:
        path = settings.model_dir.expanduser()
    else:
        cache = Path(os.environ.get("REPROLANE_CACHE_DIR", "~/.cache/reprolane")).expanduser()
        path = cache / DEFAULT_MODEL_SUBDIR
    if not (path / "config.json").is_file():
        raise LaneUnavailableError(
            f"no model at {path} (run `reprolane model fetch` or set REPROLANE_REPLAYER_MODEL_DIR)"
        )
    return path


def cpu_model_name() -> str | None:
    """The CPU's "model name" from /proc/cpuinfo (Linux), else `platform.processor()`, else None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def cublas_version() -> str | None:
    """The version of the cuBLAS wheel torch loads (reduction order of GPU matmuls depends on it), else None."""
    for dist in CUBLAS_DISTS:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def effective_seed(sampling: SamplingContract) -> int | None:
    """The seed a lane passes on: the recorded one unless its scope is ``worker_global``.

    A ``worker_global`` sample drew from the worker's global RNG state, which no replay can restore; replaying it
    with the recorded (absent or unrelated) seed would only pretend otherwise, so it is sampled without one.
    """
    return None if sampling.seed_scope == "worker_global" else sampling.seed


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Silence the deprecation warnings (Deprecation, PendingDeprecation, Future) that torch, vLLM and
    transformers raise about their own internals on import and engine start (``torch.jit.script_method``,
    ``torch.distributed.reduce_op``): they are not about our use, and under ``-W error`` (our test suite) they
    would stop a lane from starting. Lane start-up only (``warnings.catch_warnings`` is not thread-safe).
    """
    with warnings.catch_warnings():
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        yield
