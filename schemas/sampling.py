"""The sampling contract: every request parameter that changes which tokens come out.

A seed only fixes random state. To replay a request the whole contract must be frozen: sampling parameters,
the seed *and its scope*, stop conditions, logits processors and length limits. Server defaults are made
explicit by the capture side (a request that sent no ``top_k`` records the server's, vLLM's ``0``), so the replayer
never has to guess what a missing field meant.
"""

from __future__ import annotations

import json
from typing import Any, Final, Literal

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


#: The request fields that constrain which tokens may come out beyond sampling (vLLM 0.32 turns each into its
#: structured-output parameters, a token mask applied to the logits at every step): `OutputConstraint`'s fields.
CONSTRAINT_FIELDS: Final = ("response_format", "structured_outputs", "text", "tools", "tool_choice")


class OutputConstraint(Record):
    """What limits which tokens may come out beyond the sampling parameters, as the request stated it: each field is
    the request's own field as compact JSON in the client's key order (the constraint itself, a schema, a regex, a
    list of choices, a grammar, the tools offered; never a name standing for one). Not sorted: a JSON schema's
    property order is the order a grammar makes the model write the properties in.

    vLLM applies these as a per-step token mask (its structured outputs): chat's ``response_format``
    (``json_schema``, ``json_object``, ``structural_tag``), its own ``structured_outputs`` (``json``, ``regex``,
    ``choice``, ``grammar``, ``json_object``, ``structural_tag``), the Responses API's ``text`` (``text.format``),
    and the ``tools`` offered: the server's tool-call parser turns them, by ``tool_choice``, into a mask of its own
    (vLLM 0.32: a JSON schema of calls for ``"required"`` or a named function; a structural tag, which lets text
    through until a call starts, for parsers that have one, ``"auto"`` included). ``tool_choice`` ``"none"``
    masks nothing. The tools are also rendered into the prompt (its token ids hold them). A replay applies the
    same constraint through the engine's own code or refuses, naming it (`constrains` says whether there may be
    one to apply).
    """

    response_format: str | None = None
    structured_outputs: str | None = None
    text: str | None = Field(default=None, description="the Responses API's text (its format is the constraint)")
    tools: str | None = None
    tool_choice: str | None = None

    @property
    def constrains(self) -> bool:
        """Whether a token mask may apply (see the class docstring): a response format other than text, structured
        outputs, a Responses text format other than text, or tools offered with a tool choice other than none
        (whether the server's parser masks then depends on the parser)."""
        text = _loaded(self.text)
        text_format = text.get("format") if isinstance(text, dict) else None
        return (
            _is_format(_loaded(self.response_format))
            or self.structured_outputs is not None
            or _is_format(text_format)
            or (self.tools is not None and _loaded(self.tool_choice) != "none")
        )

    def named(self) -> list[str]:
        """The request fields this record holds, for refusals that name them (``sampling.constraint.tools``)."""
        return [f"sampling.constraint.{name}" for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]


def _loaded(value: str | None) -> Any:
    """A constraint field's value (canonical JSON, written by the capture side); None when absent."""
    return None if value is None else json.loads(value)


def _is_format(value: Any) -> bool:
    """A response format that constrains: any but none and ``{"type": "text"}``."""
    return value is not None and not (isinstance(value, dict) and value.get("type") == "text")


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
    constraint: OutputConstraint | None = Field(
        default=None, description="structured outputs and tool choice: a token mask applied at every step"
    )
    extra: dict[str, str] = Field(
        default_factory=dict,
        description="other output-affecting parameters passed through verbatim (name -> canonical JSON)",
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def unseeded(self) -> bool:
        """Sampled from the engine's global random state (no per-request seed): no replay can restore it, so its
        tokens cannot be expected to repeat on any lane."""
        return self.seed_scope == "worker_global" and not self.greedy
