"""The reference lane: plain transformers in float32, deterministic algorithms, a fixed thread count.

What it is for: a second opinion from an independent engine. A greedy replay here tells whether a production
output is what the model itself produces, away from vLLM's kernels and schedule. It is *not* expected to be
bitwise identical to a vLLM capture (other kernels, float32 rather than bfloat16): its fingerprint differs in
engine and dtype, and the verdict says so.

Sampling: greedy decoding is comparable across engines. Seeded sampling runs here too (temperature, top_p,
top_k, min_p, repetition_penalty through ``generate``; the seed seeds torch's RNG inside ``fork_rng``, because
``generate`` takes no ``torch.Generator``), but engines draw random numbers differently, so a sampled replay on
this lane is not expected to match another engine token for token; it only replays itself. Parameters that
``generate`` has no equivalent for (presence/frequency penalties, logit bias, extra, logits processors) make the
request `NotReplayableError` on this lane rather than silently replayed without them.

Why one sequence at a time: on a GPU (``benchmarks/gpu_lane_check.py``, figures in BENCHMARKS.md) this lane
replays every prompt with identical token ids and logprobs run to run, while the same prompts generated together
in one padded batch fork some of their bfloat16 outputs, with ``torch.use_deterministic_algorithms`` on or off:
determinism is run to run, it does not make a batch's neighbours irrelevant.

Logprobs are ``log_softmax`` of the raw logits at each step (before temperature and penalties), which is what
vLLM reports by default, so the two lanes' logprobs are comparable. Process-wide side effects:
``torch.use_deterministic_algorithms(True)`` and ``torch.set_num_threads(settings.num_threads)``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.adapters import refuse
from replayer.lanes.base import GenRequest, effective_seed, quiet_imports, resolve_model_dir, torch_lane_fingerprint
from replayer.lanes.engine_thread import set_torch_threads
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint, SamplingContract, StepLogprobs, TopCandidate

DTYPE = "float32"


def _unsupported(sampling: SamplingContract) -> list[str]:
    names = []
    if sampling.presence_penalty:
        names.append("presence_penalty")
    if sampling.frequency_penalty:
        names.append("frequency_penalty")
    if sampling.logit_bias:
        names.append("logit_bias")
    if sampling.logits_processors:
        names.append("logits_processors")
    names.extend(f"extra.{k}" for k in sampling.extra)
    if sampling.constraint is not None and sampling.constraint.constrains:  # no structured-output backend here
        names.extend(name.removeprefix("sampling.") for name in sampling.constraint.named())
    return names


class TransformersLane:
    """transformers ``generate`` on the CPU (or the first GPU), one sequence at a time."""

    name = "transformers"

    def __init__(self, settings: ReplayerSettings) -> None:
        model_dir = resolve_model_dir(settings)
        # Deterministic cuBLAS on a GPU (torch.use_deterministic_algorithms refuses CUDA matmuls without it);
        # read when the first cuBLAS handle is made, so setting it here is in time. Harmless on the CPU.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        try:
            with quiet_imports():
                import torch
                import transformers
                from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise LaneUnavailableError(f"the transformers lane needs the lanes extra: {exc}") from exc
        torch.use_deterministic_algorithms(True)
        set_torch_threads(torch, settings.num_threads)
        self._torch = torch
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            with quiet_imports():
                self._tok = AutoTokenizer.from_pretrained(model_dir)
                model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            self._model = model.to(self._device)
        except (OSError, ValueError) as exc:
            raise LaneUnavailableError(f"transformers cannot load {model_dir}: {exc}") from exc
        self._model.eval()
        self._lock = threading.Lock()
        self._fingerprint = torch_lane_fingerprint(
            torch,
            engine="transformers",
            engine_version=transformers.__version__,
            dtype=DTYPE,
            attention_backend=str(getattr(self._model.config, "_attn_implementation", None) or "") or None,
            batch_invariant=False,
        )

    def fingerprint(self) -> RuntimeFingerprint:
        return self._fingerprint

    def _generate_kwargs(self, sampling: SamplingContract, max_tokens: int) -> dict[str, Any]:
        unsupported = _unsupported(sampling)
        if unsupported:
            raise NotReplayableError(f"the transformers lane cannot apply: {', '.join(unsupported)}")
        eos = self._model.generation_config.eos_token_id
        eos_ids = [] if sampling.ignore_eos or eos is None else ([eos] if isinstance(eos, int) else list(eos))
        eos_ids += [t for t in sampling.stop_token_ids if t not in eos_ids]
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "min_new_tokens": min(sampling.min_tokens, max_tokens) or None,
            "eos_token_id": eos_ids or None,
            "pad_token_id": eos_ids[0] if eos_ids else 0,
            "repetition_penalty": sampling.repetition_penalty,
            "output_logits": True,
            "return_dict_in_generate": True,
        }
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                min_p=sampling.min_p or None,
            )
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self._tok)
        return kwargs

    def replay(self, request: GenRequest) -> ReplayedOutput:
        refuse(request.adapter, self.name)  # not built: it would need peft (not in the lanes extra)
        torch = self._torch
        max_tokens, top_k_logprobs = request.max_tokens, request.top_k_logprobs
        kwargs = self._generate_kwargs(request.sampling, max_tokens)
        ids = torch.tensor([list(request.prompt_token_ids)], dtype=torch.long, device=self._device)
        seed = effective_seed(request.sampling)
        with self._lock, torch.inference_mode(), torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            out = self._model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        new = out.sequences[0, ids.shape[1] :].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float()  # (steps, vocab), raw logits
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, torch.tensor(new, device=logprobs.device)[:, None])[:, 0].tolist()
        steps: list[StepLogprobs] = []
        if top_k_logprobs > 0:
            top_lp, top_ids = logprobs.topk(top_k_logprobs, dim=-1)
            top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
        else:
            top_lp_rows, top_id_rows = [[] for _ in new], [[] for _ in new]
        for tid, c_lp, row_ids, row_lps in zip(new, chosen, top_id_rows, top_lp_rows, strict=True):
            top = tuple(
                TopCandidate(token=self._tok.decode([t]), token_id=t, logprob=lp, rank=r)
                for r, (t, lp) in enumerate(zip(row_ids, row_lps, strict=True), start=1)
            )
            steps.append(StepLogprobs(token_id=tid, token=self._tok.decode([tid]), logprob=c_lp, top=top))
        eos_ids = kwargs["eos_token_id"] or []
        stopped = bool(new) and (new[-1] in eos_ids or len(new) < max_tokens)
        return ReplayedOutput(
            token_ids=tuple(new),
            text=self._tok.decode(new, skip_special_tokens=True),
            logprobs=tuple(steps),
            finish_reason="stop" if stopped else "length",
        )

    def close(self) -> None:
        with self._lock:
            self._model = None
