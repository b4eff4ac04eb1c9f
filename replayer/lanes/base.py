"""The lane interface: one execution environment that re-runs a recorded request.

A lane takes one `GenRequest` (the recorded prompt token ids and sampling contract, with the replay's length
and top-k) and returns what it generated, with per-step top-k logprobs, plus the `schemas.RuntimeFingerprint` of
itself (so a replay can name which environment fields differ from the capture). Lanes are blocking; the service
runs them in a worker thread and never runs two replays on one lane at once (a lane is a fixed schedule: one
sequence at a time).

Also here, what the lanes share: the request (`GenRequest`, which the matrix's batch engine takes too), the model
folder (`resolve_model_dir`), the host facts a fingerprint records (`cpu_model_name`, `cublas_version`) and the
fingerprint of a lane on torch (`torch_lane_fingerprint`), the seed a replay may pass on (`effective_seed`), and
the warning filter for engine start-up (`quiet_imports`).

Heavy imports (torch, vllm, transformers) live in the lane modules, inside functions only.
"""

from __future__ import annotations

import os
import platform
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from infra.clients.installed import installed_version
from replayer.errors import LaneUnavailableError
from replayer.lanes.adapters import Adapter
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint, SamplingContract
from schemas.fingerprint import cpu_model_name_of

DEFAULT_MODEL_SUBDIR = "models/smollm2-135m-instruct"

#: Wheels that bring cuBLAS with torch (CUDA 13, CUDA 12, unsuffixed), first installed wins.
CUBLAS_DISTS = ("nvidia-cublas-cu13", "nvidia-cublas-cu12", "nvidia-cublas")


@dataclass(frozen=True)
class GenRequest:
    """One generation: prompt ids and sampling contract, plus the length and top-k width the caller asks for.

    ``max_tokens`` overrides the contract's (a replay is bounded by the recorded length,
    `replayer.replay.replay_budget`); ``top_k_logprobs`` is how many alternatives each step reports (0: the
    chosen token's logprob only); ``tool_call_parser`` is production's (`schemas.RuntimeFingerprint`), which
    turns offered tools into a constraint (`replayer.lanes.vllm_params.structured_outputs`); ``adapter`` is the
    LoRA adapter the request ran with (`schemas.ArtifactHashes`), which a lane loads or refuses
    (`replayer.lanes.adapters`), never ignores.
    """

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingContract
    _: KW_ONLY
    max_tokens: int
    top_k_logprobs: int
    tool_call_parser: str | None = None
    adapter: Adapter | None = None


@runtime_checkable
class Lane(Protocol):
    """An execution lane. Implementations: `VllmLane`, `RemoteLane`, `TransformersLane`."""

    name: str

    def fingerprint(self) -> RuntimeFingerprint:
        """The runtime fingerprint of this lane (stable for the lane's lifetime)."""
        ...

    def replay(self, request: GenRequest) -> ReplayedOutput:
        """Generate from the request's prompt ids under its contract; blocking."""
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
            name = cpu_model_name_of(fh)
    except OSError:
        name = None
    return (name or None) if name is not None else (platform.processor() or None)


#: the structured-output backend setting of the lanes' vLLM engines: vLLM's default, which picks xgrammar or
#: guidance per request
LANE_STRUCTURED_OUTPUTS_BACKEND: Final = "auto"


def cublas_version() -> str | None:
    """The version of the cuBLAS wheel torch loads (reduction order of GPU matmuls depends on it), else None."""
    return next((v for dist in CUBLAS_DISTS if (v := installed_version(dist)) is not None), None)


def torch_lane_fingerprint(
    torch: Any,
    *,
    engine: str,
    engine_version: str,
    dtype: str,
    attention_backend: str | None,
    batch_invariant: bool,
    structured_outputs: str | None = None,
) -> RuntimeFingerprint:
    """The fingerprint of a lane that runs on ``torch`` (the imported module) in this process.

    Such a lane runs on the first GPU when torch sees one, else on the CPU, and always on the same fixed schedule:
    one sequence at a time, no prefix cache, eager (no CUDA graphs), unquantized, no tensor, pipeline or data
    parallelism. What differs between the lanes is passed in.
    """
    on_gpu = bool(torch.cuda.is_available())
    device_name, capability = cpu_model_name(), None
    if on_gpu:
        device_name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        capability = f"{major}.{minor}"
    return RuntimeFingerprint(
        engine=engine,
        engine_version=engine_version,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if on_gpu else None,
        cublas_version=cublas_version() if on_gpu else None,
        device="cuda" if on_gpu else "cpu",
        device_name=device_name,
        compute_capability=capability,
        dtype=dtype,
        quantization="none",
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        data_parallel_size=1,
        attention_backend=attention_backend,
        cuda_graphs=False,
        batch_invariant=batch_invariant,
        max_num_seqs=1,
        prefix_caching=False,
        num_threads=torch.get_num_threads(),
        structured_outputs=structured_outputs,
    )


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
