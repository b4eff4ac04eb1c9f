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
LoRA: with adapters configured (``settings.lora_modules``) the engine starts with LoRA enabled (one adapter at a
time, production's ``max_lora_rank``) and a request that ran with an adapter loads the lane's copy, checked against
the recorded digest (`replayer.lanes.adapters`).
Seeds: a ``per_request`` seed goes to vLLM's per-request generator and replays exactly; ``worker_global``
requests are sampled without a seed (see `replayer.lanes.base.effective_seed`).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Sequence
from typing import Any, cast

from infra.clients.installed import installed_structured_outputs
from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.adapters import LocalAdapters
from replayer.lanes.base import (
    LANE_STRUCTURED_OUTPUTS_BACKEND,
    GenRequest,
    quiet_imports,
    resolve_model_dir,
    torch_lane_fingerprint,
)
from replayer.lanes.engine_thread import EngineThread, set_torch_threads
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


def steps_from_vllm(token_ids: Sequence[int], logprobs: Sequence[Any] | None) -> tuple[StepLogprobs, ...] | None:
    """vLLM's per-step ``{token_id: Logprob}`` dicts -> `StepLogprobs`, every entry kept in the dict's order.

    vLLM builds a step's dict from the sampled token followed by the top-k ranks: k entries when the sampled token
    is among them, k + 1 (the sampled token first) when it is not. A server's answer is a view of that dict that
    depends on the endpoint (`replayer.replay.server_view`), so a lane keeps all of it, with vLLM's ranks, and the
    replay takes the view the recorded endpoint gave.
    """
    if logprobs is None:
        return None
    steps = []
    for tid, entry in zip(token_ids, logprobs, strict=True):
        chosen = entry[tid]
        top = tuple(
            TopCandidate(
                token=lp.decoded_token or "",
                token_id=int(t),
                logprob=max(float(lp.logprob), MIN_LOGPROB),
                rank=lp.rank,
            )
            for t, lp in entry.items()
        )
        steps.append(
            StepLogprobs(
                token_id=int(tid),
                token=chosen.decoded_token,
                logprob=max(float(chosen.logprob), MIN_LOGPROB),
                top=top,
            )
        )
    return tuple(steps)


def output_from_vllm(out: Any) -> ReplayedOutput:
    """One of vLLM's ``CompletionOutput`` as a `ReplayedOutput` (every logprob entry vLLM returned per step)."""
    token_ids = tuple(int(t) for t in out.token_ids)
    return ReplayedOutput(
        token_ids=token_ids,
        text=out.text,
        logprobs=steps_from_vllm(token_ids, out.logprobs),
        finish_reason=out.finish_reason,
    )


def release_engine(engine: Any) -> None:
    """Free one in-process ``LLMEngine`` and leave this process's distributed state to the other engines.

    vLLM's own shutdown (``EngineCore.shutdown``, which the in-process client's finalizer also runs when an engine
    is collected) ends by tearing down the process-wide tensor and pipeline parallel groups, and every in-process
    engine shares them. The replayer runs two engines in one process (this lane and a schedule lane): closing one
    the vLLM way makes the other's next step fail with "pipeline model parallel group is not initialized". So the
    finalizer is detached and the rest of that shutdown runs here; the groups live until the process exits.
    """
    client = engine.engine_core
    finalizer = getattr(client, "_finalizer", None)
    if finalizer is not None and finalizer.detach() is None:
        return  # already shut down
    core = getattr(client, "engine_core", None)
    if core is None:
        return
    if (manager := getattr(core, "structured_output_manager", None)) is not None:
        manager.clear_backend()
    if getattr(core, "model_executor", None) is not None:
        core.model_executor.shutdown()
    if getattr(core, "scheduler", None) is not None:
        core.scheduler.shutdown()
    gc.unfreeze()  # EngineCore froze what it allocated at start; let the collector see it again


def _batch_invariant_active() -> bool:
    from vllm import envs

    return bool(envs.VLLM_BATCH_INVARIANT)


class VllmLane:
    """vLLM in this process, one sequence at a time. Thread-safe: replays are serialised by a lock, and the
    engine is built and run on its own thread (`replayer.lanes.engine_thread`)."""

    name = "vllm"

    def __init__(self, settings: ReplayerSettings) -> None:
        self._thread = EngineThread("vllm-lane")
        try:
            self._thread.call(self._start, settings)
        except BaseException:
            self._thread.close()
            raise

    def _start(self, settings: ReplayerSettings) -> None:
        model_dir = resolve_model_dir(settings)
        try:
            with quiet_imports():
                import torch
        except ImportError as exc:
            raise LaneUnavailableError(f"the vllm lane needs the lanes extra (torch): {exc}") from exc
        on_gpu = bool(torch.cuda.is_available())
        _prepare_environment(on_gpu)
        if not on_gpu and settings.vllm_num_threads:
            set_torch_threads(torch, settings.vllm_num_threads)
        try:
            with quiet_imports():
                import vllm
                from vllm import LLM
        except ImportError as exc:
            raise LaneUnavailableError(f"the vllm lane needs the lanes extra (vllm): {exc}") from exc
        self._adapters = LocalAdapters(settings.lora_modules, max_rank=settings.max_lora_rank)
        lora: dict[str, Any] = {}
        if self._adapters:  # only then: an engine without adapters runs no LoRA layers at all
            lora = {"enable_lora": True, "max_lora_rank": settings.max_lora_rank, "max_loras": 1}
        try:
            with quiet_imports():
                self._llm = LLM(
                    model=str(model_dir),
                    dtype=cast(Any, settings.dtype),
                    enforce_eager=True,
                    max_num_seqs=1,
                    enable_prefix_caching=False,
                    seed=ENGINE_SEED,
                    **lora,
                )
        except Exception as exc:  # vLLM raises many types; all mean "this lane cannot start here"
            mode = "batch-invariant GPU mode" if on_gpu else "CPU mode"
            raise LaneUnavailableError(f"vLLM refused to start in {mode}: {type(exc).__name__}: {exc}") from exc
        self._lock = threading.Lock()
        self._closed = False
        if on_gpu and not _batch_invariant_active():
            release_engine(self._llm.llm_engine)  # on this engine thread already: not through close()
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
            structured_outputs=installed_structured_outputs(LANE_STRUCTURED_OUTPUTS_BACKEND),
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
            params = SamplingParams(**sampling_kwargs(request, self._llm.get_tokenizer()))
        except (TypeError, ValueError) as exc:
            raise NotReplayableError(f"vLLM rejects the recorded sampling contract: {exc}") from exc
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        lora = None
        if request.adapter is not None:
            from vllm.lora.request import LoRARequest

            copy = self._adapters.resolve(request.adapter)
            lora = LoRARequest(copy.name, copy.engine_id, str(copy.path))
        with self._lock:
            if self._closed:
                raise LaneUnavailableError("the vllm lane is closed")
            outputs = self._thread.call(self._llm.generate, [prompt], params, use_tqdm=False, lora_request=lora)
        return output_from_vllm(outputs[0].outputs[0])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            llm = self._llm
            del self._llm
        self._thread.call(release_engine, llm.llm_engine)
        self._thread.close()
