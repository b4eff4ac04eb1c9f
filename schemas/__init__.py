"""The reprolane contract: what is recorded, replayed and reported, and how it is encoded.

This package is pure: pydantic models, a canonical encoding, topic names and the object-key layout.
It imports nothing else of reprolane's and does no IO, so any service (or a non-Python consumer, via the exported
JSON Schema) can depend on it. The connection fields the services' settings share (and read secret files for)
live beside the clients they configure, in `infra.clients.connection`.

- `base`: the base model of every record (`Record`) and `decode_record`, which parses one from JSON and names
  each offending field.
- `envelope`: the Request Reproducibility Envelope and its captured outcome.
- `envelope_codec`: the envelope's canonical bytes written fast (msgspec for the per-token logprobs), exactly.
- `envelope_compact`: the compact storage and transport form of those bytes, and `envelope_bytes`, which every
  reader of stored or consumed envelopes decodes with; its columns and frames (`compact_columns`) and its
  per-token logprob columns (`compact_steps`).
- `sampling`: the sampling contract (every parameter that changes which tokens come out).
- `fingerprint`: the runtime fingerprint and the field-by-field diff between two of them.
- `environment`: artifacts + runtime, the unit the release gate compares.
- `known_good`: the environments passing gates recorded (image, model manifest, engine arguments): rollback targets.
- `replay`: replay results and divergence events.
- `replay_auth`: signing and verifying on-demand replay requests (HMAC-SHA256, a bounded age, the replay role).
- `canonical`: deterministic bytes and the sha256 identities built on them.
- `layout`: Kafka topic names, header names and every S3 object key, prefix and partition path.
- `manifest`: the model manifest and the runtime file a deployment declares, each with its one decoder.
- `sealed`: per-tenant encryption of stored envelopes (AES-256-GCM) and wrapped data keys (crypto-shredding).
- `schedule_delivery`: how the engine's schedule log travels and is joined to envelopes (segments read bounded and
  checked, the envelope's `ScheduleRef`, the index entry, the external id vLLM derives from ``X-Request-Id``).
- `claim_check`: the reference Kafka carries instead of an envelope too large for a record (S3 key, size, sha256).
- `errors`: the one exception a consumer of the contract needs to catch.
"""

from schemas.canonical import canonical_bytes, sha256_hex
from schemas.envelope import (
    ArtifactHashes,
    CapturedError,
    CapturedOutput,
    Choice,
    Envelope,
    ExecutionContext,
    Outcome,
    PromptRecord,
    ShadowMarker,
    StepLogprobs,
    Timings,
    ToolCall,
    TopCandidate,
    WorkflowRef,
    decode_envelope,
    use_canonical_writer,
    use_envelope_reader,
)
from schemas.envelope_codec import canonical_envelope
from schemas.envelope_compact import envelope_bytes
from schemas.environment import EnvironmentFingerprint, decode_environment, diff_environments
from schemas.errors import ContractError
from schemas.fingerprint import FieldDiff, RuntimeFingerprint, diff_fingerprints
from schemas.levels import LEVEL_ORDER, ReproLevel
from schemas.replay import (
    ChoiceCheck,
    DivergenceEvent,
    FirstDivergence,
    ReplayedOutput,
    ReplayRequest,
    ReplayResult,
    StepCandidates,
    decode_divergence,
    decode_replay_request,
    decode_replay_result,
)
from schemas.sampling import SAMPLING_CONTRACT_VERSION, OutputConstraint, SamplingContract

use_canonical_writer(canonical_envelope)  # `Envelope.canonical` writes with the codec (see `schemas.envelope_codec`)
use_envelope_reader(envelope_bytes)  # `decode_envelope` reads compact records too (see `schemas.envelope_compact`)

__all__ = [
    "LEVEL_ORDER",
    "SAMPLING_CONTRACT_VERSION",
    "ArtifactHashes",
    "CapturedError",
    "CapturedOutput",
    "Choice",
    "ChoiceCheck",
    "ContractError",
    "DivergenceEvent",
    "Envelope",
    "EnvironmentFingerprint",
    "ExecutionContext",
    "FieldDiff",
    "FirstDivergence",
    "Outcome",
    "OutputConstraint",
    "PromptRecord",
    "ReplayRequest",
    "ReplayResult",
    "ReplayedOutput",
    "ReproLevel",
    "RuntimeFingerprint",
    "SamplingContract",
    "ShadowMarker",
    "StepCandidates",
    "StepLogprobs",
    "Timings",
    "ToolCall",
    "TopCandidate",
    "WorkflowRef",
    "canonical_bytes",
    "decode_divergence",
    "decode_envelope",
    "decode_environment",
    "decode_replay_request",
    "decode_replay_result",
    "diff_environments",
    "diff_fingerprints",
    "envelope_bytes",
    "sha256_hex",
]
