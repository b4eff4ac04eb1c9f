"""The sampling contract: every request parameter that changes which tokens come out.

A seed only fixes random state. To replay a request the whole contract must be frozen: sampling parameters,
the seed *and its scope*, stop conditions, logits processors and length limits. Server defaults are made
explicit by the capture side (a request that sent no ``top_k`` records the server's, vLLM's ``0``), so the replayer
never has to guess what a missing field meant.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import Field

from schemas.base import Record

SAMPLING_CONTRACT_VERSION: Final = "reprolane.sampling/1"

#: The fields of a model's ``generation_config.json`` (and of vLLM's ``--override-generation-config``) that vLLM 0.32
#: takes as sampling defaults (``ModelConfig.get_diff_sampling_param``), each with its name in the contract (Hugging
#: Face's ``max_new_tokens`` is ``max_tokens``). Written into the manifest by ``reprolane model fetch``; read by the
#: capture sidecar.
GENERATION_CONFIG_FIELDS: Final = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}

SeedScope = Literal["per_request", "worker_global", "none"]
"""``per_request``: the request carried a seed (or the sidecar injected one) and the engine seeds a generator
for it alone. ``worker_global``: no per-request seed; randomness comes from the worker's global RNG state, so
sampled outputs are not replayable token for token. ``none``: greedy decoding, no randomness consumed."""


class SamplingContract(Record):
    contract_version: Literal["reprolane.sampling/1"] = SAMPLING_CONTRACT_VERSION
    temperature: float = Field(ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1, description="-1 (or 0) disables top-k")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    max_tokens: int | None = Field(
        default=None, ge=1, description="None: no limit but the server's, the rest of the context window"
    )
    min_tokens: int = Field(default=0, ge=0)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)
    seed: int | None = None
    seed_scope: SeedScope
    seed_injected: bool = Field(default=False, description="the sidecar added the seed by policy")
    logprobs: int | None = Field(default=None, ge=0, le=20, description="top-k logprobs recorded per step")
    logit_bias: dict[str, float] = Field(default_factory=dict, description="token id (as text) -> bias")
    logits_processors: tuple[str, ...] = ()
    extra: dict[str, str] = Field(
        default_factory=dict,
        description="other output-affecting parameters passed through verbatim (name -> canonical JSON)",
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
