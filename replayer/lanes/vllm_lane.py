"""The in-process vLLM lane: the frozen deterministic replay lane.

Determinism mechanism, by platform:

- **CPU** (the lane this project runs): a fixed schedule. One sequence at a time (``max_num_seqs=1``), no prefix
  cache, eager mode (no CUDA graphs / torch.compile), a fixed engine seed. The same request on the same build
  then yields bitwise identical ids and logprobs (measured in shared/STACK.md and in
  tests/replayer/test_lanes_stack.py). vLLM's batch-invariant kernels do not exist on the CPU, so the
  fingerprint says ``batch_invariant=False`` and names the schedule instead.
- **GPU**: the same schedule plus ``VLLM_BATCH_INVARIANT=1`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set before
  vLLM is imported. When vLLM refuses the platform or attention backend in that mode, the lane refuses to start
  (`LaneUnavailableError` with vLLM's reason) rather than replay on a non-invariant path.

The environment variables are process-wide and must be in place before the first ``import vllm`` in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this process, so a replay is a function call).
Seeds: a ``per_request`` seed goes to vLLM's per-request generator and replays exactly; ``worker_global``
requests are sampled without a seed (see `replayer.lanes.base.effective_seed`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any, cast

from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.base import GenRequest, quiet_imports, resolve_model_dir, torch_lane_fingerprint
from replayer.lanes.vllm_params import sampling_kwargs
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint, StepLogprobs, TopCandidate

ENGINE_SEED = 0
#: vLLM can report -inf for a token it masked; contract records refuse infinities, so clamp as vLLM's server does.
MIN_LOGPROB = -9999.0


def _prepare_environment(on_gpu: bool) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's INFO lines at every engine start would bury an auditor's report; VLLM_LOGGING_LEVEL=INFO brings them back
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if on_gpu:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"


def steps_from_vllm(
    token_ids: Sequence[int], logprobs: Sequence[Any] | None, k: int
) -> tuple[StepLogprobs, ...] | None:
    """vLLM's per-step ``{token_id: Logprob}`` dicts -> `StepLogprobs`, top-k sorted by rank (rank <= k only).

    vLLM adds the sampled token to each dict even when it is outside the top-k; it is kept as the step's chosen
    token and left out of ``top`` so that every step reports exactly the top-k.
    """
    if logprobs is None:
        return None
    steps = []
    for tid, entry in zip(token_ids, logprobs, strict=True):
        chosen = entry[tid]
        top = sorted(
            (
                TopCandidate(
                    token=lp.decoded_token or "",
                    token_id=int(t),
                    logprob=max(float(lp.logprob), MIN_LOGPROB),
                    rank=lp.rank,
                )
                for t, lp in entry.items()
                if lp.rank is not None and lp.rank <= k
            ),
            key=lambda c: (c.rank, -c.logprob),
        )
        steps.append(
            StepLogprobs(
                token_id=int(tid),
                token=chosen.decoded_token,
                logprob=max(float(chosen.logprob), MIN_LOGPROB),
                top=tuple(top),
            )
        )
    return tuple(steps)


def output_from_vllm(out: Any, k: int) -> ReplayedOutput:
    """One of vLLM's ``CompletionOutput`` as a `ReplayedOutput` (top-``k`` logprobs per step)."""
    token_ids = tuple(int(t) for t in out.token_ids)
    return ReplayedOutput(
        token_ids=token_ids,
        text=out.text,
        logprobs=steps_from_vllm(token_ids, out.logprobs, k),
        finish_reason=out.finish_reason,
    )


def _batch_invariant_active() -> bool:
    from vllm import envs

    return bool(envs.VLLM_BATCH_INVARIANT)


class VllmLane:
    """vLLM in this process, one sequence at a time. Thread-safe: replays are serialised by a lock."""

    name = "vllm"

    def __init__(self, settings: ReplayerSettings) -> None:
        model_dir = resolve_model_dir(settings)
        try:
            with quiet_imports():
                import torch
        except ImportError as exc:
            raise LaneUnavailableError(f"the vllm lane needs the lanes extra (torch): {exc}") from exc
        on_gpu = bool(torch.cuda.is_available())
        _prepare_environment(on_gpu)
        try:
            with quiet_imports():
                import vllm
                from vllm import LLM
        except ImportError as exc:
            raise LaneUnavailableError(f"the vllm lane needs the lanes extra (vllm): {exc}") from exc
        try:
            with quiet_imports():
                self._llm = LLM(
                    model=str(model_dir),
                    dtype=cast(Any, settings.dtype),
                    enforce_eager=True,
                    max_num_seqs=1,
                    enable_prefix_caching=False,
                    seed=ENGINE_SEED,
                )
        except Exception as exc:  # vLLM raises many types; all mean "this lane cannot start here"
            mode = "batch-invariant GPU mode" if on_gpu else "CPU mode"
            raise LaneUnavailableError(f"vLLM refused to start in {mode}: {type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()
        self._closed = False
        if on_gpu and not _batch_invariant_active():
            self.close()
            raise LaneUnavailableError(
                "VLLM_BATCH_INVARIANT is not in effect (vLLM was imported before the lane set it?); refusing to "
                "replay on a GPU path that is not batch-invariant"
            )
        self._fingerprint = torch_lane_fingerprint(
            torch,
            engine="vllm",
            engine_version=vllm.__version__,
            dtype=settings.dtype,
            attention_backend=self._attention_backend(),
            batch_invariant=on_gpu,
        )

    def _attention_backend(self) -> str | None:
        """Best effort: the backend the worker selected (internal attributes; None when they moved)."""
        try:
            engine: Any = self._llm.llm_engine
            core = engine.engine_core.engine_core
            runner = core.model_executor.driver_worker.worker.model_runner
            groups = runner.attn_groups
            return str(groups[0][0].backend.get_name())
        except Exception:
            from vllm.platforms import current_platform

            return "CPU_ATTN" if current_platform.is_cpu() else None

    def fingerprint(self) -> RuntimeFingerprint:
        return self._fingerprint

    def replay(self, request: GenRequest) -> ReplayedOutput:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        try:
            params = SamplingParams(**sampling_kwargs(request))
        except (TypeError, ValueError) as exc:
            raise NotReplayableError(f"vLLM rejects the recorded sampling contract: {exc}") from exc
        with self._lock:
            if self._closed:
                raise LaneUnavailableError("the vllm lane is closed")
            outputs = self._llm.generate(
                [TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))], params, use_tqdm=False
            )
        return output_from_vllm(outputs[0].outputs[0], request.top_k_logprobs)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            llm = self._llm
            del self._llm
        shutdown = getattr(llm.llm_engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
