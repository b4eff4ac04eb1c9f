"""The Request Reproducibility Envelope: one immutable record per request that reached the sidecar.

An envelope freezes everything needed to re-run the same computation (prompt *token ids*, not only text;
the sampling contract; the artifact hashes; the runtime fingerprint; the batch pressure it ran under) and
what came out (token ids and per-step top-k logprobs), or the error that ended it.

Identity: ``envelope_id`` = sha256 of the canonical encoding (see `schemas.canonical`) of the whole record.
Two deliveries of the same envelope therefore collapse to one id; any change to any field yields a new id.
`schemas.envelope_codec` writes those bytes faster than the generic encoder (the same bytes, tested so).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Final, Literal

from pydantic import Field, field_validator, model_validator

from schemas.base import Record, UtcDatetime, decode_record
from schemas.canonical import canonical_bytes, sha256_hex
from schemas.fingerprint import RuntimeFingerprint
from schemas.levels import ReproLevel
from schemas.sampling import SamplingContract
from schemas.schedule_delivery import ScheduleRef

ENVELOPE_SCHEMA_VERSION: Final = "reprolane.envelope/1"

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
RequestId = Annotated[str, Field(pattern=_ID_RE.pattern)]


def is_valid_request_id(value: str) -> bool:
    return bool(_ID_RE.match(value))


#: The sidecar's own request ids: this prefix and 128 random bits in hex (``capture.request.request_headers``).
SIDECAR_REQUEST_ID_PREFIX: Final = "rl-"
_SIDECAR_ID_RE = re.compile(rf"^{SIDECAR_REQUEST_ID_PREFIX}[0-9a-f]{{32}}$")


def is_sidecar_request_id(value: str) -> bool:
    """Whether `value` has the shape of an id the sidecar mints (a client's X-Request-Id usually has not)."""
    return bool(_SIDECAR_ID_RE.fullmatch(value))


#: The captured endpoints, as an envelope names them (the sidecar's request path dispatches on it).
Endpoint = Literal["chat.completions", "completions", "responses", "messages"]


class WorkflowRef(Record):
    """Where a request sits in an agent workflow, so a workflow can be replayed step by step."""

    workflow_id: RequestId
    step: int = Field(ge=0)


class ArtifactHashes(Record):
    """Immutable fingerprints of the model artifacts (from the deployment manifest).

    A request whose ``model`` names a LoRA adapter upstream serves (vLLM's ``--lora-modules NAME=PATH``, declared to
    the sidecar the same way) also records the adapter: its name and the digest of every file of its directory
    (``infra.clients.digest.directory_sha256``: the same rule as the model's digests). A lane loads the adapter of
    that name only when its own copy has that digest. Both None: the request ran on the base model alone (absent
    fields are dropped from the canonical bytes, so envelopes written before adapters keep their ids).
    """

    model_sha256: Sha256 | None = None
    tokenizer_sha256: Sha256 | None = None
    chat_template_sha256: Sha256 | None = None
    manifest_source: str | None = Field(default=None, description="where the hashes came from")
    adapter_name: str | None = Field(default=None, max_length=256, description="the LoRA adapter the request named")
    adapter_sha256: Sha256 | None = Field(default=None, description="digest of every file of the adapter directory")

    @model_validator(mode="after")
    def _adapter_whole(self) -> ArtifactHashes:
        if (self.adapter_name is None) != (self.adapter_sha256 is None):
            raise ValueError("adapter_name and adapter_sha256 are recorded together or not at all")
        return self


class PromptRecord(Record):
    token_ids: tuple[int, ...] = Field(min_length=1)
    source: Literal["upstream", "tokenize", "lane"] = Field(
        description="upstream: the server returned prompt_token_ids; tokenize: the sidecar asked /tokenize"
    )
    text: str | None = Field(default=None, description="rendered prompt, when known")

    @field_validator("token_ids")
    @classmethod
    def _non_negative(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if v and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        return v


class TopCandidate(Record):
    """One of the top-k alternatives at a step. ``token_id`` is None when the server gave only text."""

    token: str
    token_id: int | None = None
    logprob: float
    rank: int | None = Field(default=None, ge=1)


class StepLogprobs(Record):
    """The chosen token at one generation step and the top-k alternatives the server reported."""

    token_id: int = Field(ge=0)
    token: str | None = None
    logprob: float
    top: tuple[TopCandidate, ...] = ()


class ToolCall(Record):
    """A call the model made, as upstream's tool-call parser read it from the generated tokens (which the choice's
    ``token_ids`` hold): the function's name and its arguments as upstream gave them (JSON text, not re-encoded)."""

    id: str | None = Field(default=None, max_length=256, description="upstream's call id (random: not replayed)")
    name: str = Field(max_length=1024)
    arguments: str = Field(default="", max_length=1 << 20)


class Choice(Record):
    index: int = Field(ge=0)
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    logprobs: tuple[StepLogprobs, ...] | None = Field(
        default=None, description="per generated token, aligned with token_ids"
    )
    tool_calls: tuple[ToolCall, ...] | None = Field(
        default=None, min_length=1, description="the tool calls upstream parsed from the output (None: none)"
    )


class Timings(Record):
    received_at: datetime
    upstream_ms: float = Field(ge=0.0, description="first request byte to upstream's last byte")
    first_token_ms: float | None = Field(default=None, ge=0.0)
    added_ms: float | None = Field(default=None, ge=0.0, description="sidecar overhead, when measured")


class CapturedOutput(Record):
    kind: Literal["output"] = "output"
    choices: tuple[Choice, ...] = Field(min_length=1)
    timings: Timings
    usage: dict[str, int] = Field(default_factory=dict)


ErrorType = Literal["upstream_error", "timeout", "client_disconnect", "bad_request", "proxy_error", "incomplete"]
#: The error type of a started record (`Envelope.is_started_record`).
STARTED_ERROR_TYPE: Final = "incomplete"
"""Why a request has no complete output. ``incomplete``: the *started* record of a request whose answer had not
been relayed yet when it was written (guaranteed mode writes one before it relays a stream, so no streamed
byte reaches a client unrecorded); the envelope with the same request id written after it says how the
request ended and supersedes it (the request-id index points there); a started record with none after it is
a request the sidecar stopped serving mid-answer (a crash)."""


class CapturedError(Record):
    """The request did not produce a complete output: upstream error, timeout, client gone, bad input, or (the
    started record, ``incomplete``) not yet."""

    kind: Literal["error"] = "error"
    error_type: ErrorType
    status_code: int | None = None
    message: str
    timings: Timings
    partial: tuple[Choice, ...] = Field(default=(), description="what was streamed before the failure")


Outcome = Annotated[CapturedOutput | CapturedError, Field(discriminator="kind")]


class ExecutionContext(Record):
    """What the sidecar could see of the production lane's state (batch pressure explains many forks)."""

    in_flight_at_start: int = Field(ge=0)
    in_flight_at_end: int = Field(ge=0)
    stream: bool = False
    sidecar_id: str | None = None


class ShadowMarker(Record):
    """Set on the envelope of a *shadow* request: the sidecar sent a sampled production request again, with the same
    prompt token ids and sampling contract, to a candidate server after the client had its answer
    (`capture.request.shadow`). The envelope has the production envelope's request id and the candidate's runtime
    fingerprint and outcome; it is indexed apart (`schemas.layout.shadow_index_key`), never as the request's own.
    (No float here: `schemas.envelope_codec` writes an envelope fast only while it knows every float it holds.)"""

    production_envelope_id: Sha256 = Field(description="the envelope id of the production answer it pairs with")
    candidate: str = Field(min_length=1, max_length=2048, description="the candidate's base URL")


class Envelope(Record):
    schema_version: Literal["reprolane.envelope/1"] = ENVELOPE_SCHEMA_VERSION
    request_id: RequestId = Field(description="the sidecar's own id of the request (random, never the client's)")
    client_request_id: RequestId | None = Field(
        default=None, description="the client's X-Request-Id, as sent (its tenant's lookup key; not unique)"
    )
    captured_at: UtcDatetime
    tenant: RequestId = "default"
    workflow: WorkflowRef | None = None
    flagged: bool = Field(default=False, description="selected for replay")
    flag_reason: Literal["header", "tenant", "sample"] | None = None
    target_level: ReproLevel = "token"
    endpoint: Endpoint = Field(
        description="the API the client called: /v1/chat/completions, /v1/completions, /v1/responses (OpenAI"
        " Responses) or /v1/messages (Anthropic Messages)"
    )
    model: str = Field(min_length=1, description="the model name the client asked for")
    artifacts: ArtifactHashes
    request_body_sha256: Sha256 | None = Field(
        default=None, description="sha256 of the raw request body as the client sent it (None: no body)"
    )
    prompt: PromptRecord | None = Field(
        default=None, description="None only when the request never reached a tokenizer"
    )
    sampling: SamplingContract | None = Field(default=None, description="None only for requests rejected as invalid")
    more_prompts: tuple[PromptRecord, ...] | None = Field(
        default=None,
        min_length=1,
        description="a completions request with several prompts: the second and later ones in order (`prompt` is"
        " the first); choice i answers prompt i // n",
    )
    runtime: RuntimeFingerprint
    context: ExecutionContext
    schedule: ScheduleRef | None = Field(
        default=None,
        description="where the engine's schedule of this request is (set when upstream records schedules:"
        " schemas.schedule_delivery)",
    )
    outcome: Outcome
    shadow: ShadowMarker | None = Field(
        default=None, description="a candidate's answer to a shadowed production request (None: production's own)"
    )
    capture_limits: tuple[str, ...] | None = Field(
        default=None,
        min_length=1,
        description="what the endpoint's server could not return, so this envelope does not hold it exactly (one"
        " sentence each, naming the field: e.g. /v1/messages returns no token ids and no logprobs); None: nothing"
        " missing",
    )

    def canonical(self) -> bytes:
        """`canonical_bytes` of this envelope, byte for byte (written by `_write_canonical`)."""
        return _write_canonical(self)

    def envelope_id(self) -> str:
        """sha256 (hex) of the canonical encoding: the content address of this record."""
        return sha256_hex(self.canonical())

    @property
    def is_started_record(self) -> bool:
        """The started record of a request (outcome ``incomplete``), written before its answer was relayed; the
        envelope with the same request id written after it supersedes it (see `ErrorType`)."""
        return isinstance(self.outcome, CapturedError) and self.outcome.error_type == STARTED_ERROR_TYPE

    @property
    def replayable(self) -> bool:
        """An envelope can be replayed when it has prompt token ids, a contract and a complete output (its choice 0
        answers `prompt`, also when the request had `more_prompts`)."""
        return self.prompt is not None and self.sampling is not None and isinstance(self.outcome, CapturedOutput)


_write_canonical: Callable[[Envelope], bytes] = canonical_bytes
"""What writes `Envelope.canonical`: `canonical_bytes`, the definition, until `use_canonical_writer` puts a writer
of the same bytes in its place. The package does, with `schemas.envelope_codec.canonical_envelope`, which writes
the per-token logprobs itself; that codec reads these records, so this module cannot import it."""


def use_canonical_writer(writer: Callable[[Envelope], bytes]) -> None:
    """Make `writer` write `Envelope.canonical` (it must return exactly `canonical_bytes` of the envelope)."""
    global _write_canonical
    _write_canonical = writer


_stored_bytes: Callable[[bytes], bytes] = bytes
"""What turns stored or consumed envelope bytes into canonical JSON before `decode_envelope` parses them: the
package sets `schemas.envelope_compact.envelope_bytes` (compact records decoded, JSON as it is), which reads this
module's codec, so this module cannot import it (as with `use_canonical_writer`)."""


def use_envelope_reader(reader: Callable[[bytes], bytes]) -> None:
    """Make `reader` turn stored bytes into canonical JSON for `decode_envelope` (JSON must pass unchanged)."""
    global _stored_bytes
    _stored_bytes = reader


def decode_envelope(data: bytes | str) -> Envelope:
    """Parse an envelope from its stored bytes, canonical JSON or compact (`schemas.envelope_compact`), raising
    `ContractError` that names each offending field."""
    return decode_record(Envelope, "envelope", data if isinstance(data, str) else _stored_bytes(data))
