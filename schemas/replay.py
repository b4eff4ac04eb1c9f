"""Replay requests, replay results and divergence events.

Every replay produces a `DivergenceEvent` (verdict ``identical`` included: dashboards need the denominator)
and a `ReplayResult` that adds the replayed output itself. Results are idempotent by
(envelope id, lane fingerprint): replaying the same envelope on the same lane twice yields the same
``result_id``, so at-least-once delivery never double counts.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final, Literal

from pydantic import Field

from schemas.base import Record, decode_record
from schemas.canonical import canonical_json, sha256_hex
from schemas.envelope import RequestId, Sha256, StepLogprobs, TopCandidate
from schemas.fingerprint import FieldDiff, RuntimeFingerprint
from schemas.levels import ReproLevel

REPLAY_SCHEMA_VERSION: Final = "reprolane.replay/1"

Verdict = Literal["bitwise", "token", "numeric", "semantic", "diverged"]
"""The strictest level that holds (see `schemas.levels`), or ``diverged`` when none does."""

CauseHint = Literal[
    "identical",
    "fingerprint_changed",
    "fork_at_first_token",
    "late_fork_numeric_drift",
    "numeric_drift_no_fork",
    "length_only",
    "not_replayable",
    "unseeded_sampling",
]
"""Why a replay differs, as far as the comparison can tell. ``unseeded_sampling``: the request was sampled without a
per-request seed (seed scope ``worker_global``), so its tokens came from the worker's global random state, which
no replay restores: neither the input nor the forward pass is to blame (the capture sidecar's ``--inject-seed``
makes such requests replayable)."""


class ReplayRequest(Record):
    """Ask the replayer service to replay one request now (the on-demand topic)."""

    schema_version: Literal["reprolane.replay/1"] = REPLAY_SCHEMA_VERSION
    request_id: RequestId
    lane: str | None = Field(
        default=None,
        description="the lane asked for: 'schedule' or the service's one-at-a-time lane; None: the service chooses "
        "as every replay entry point does (the schedule lane when the envelope's schedule is there)",
    )
    reply_to: str | None = Field(default=None, description="correlation id echoed in the event")
    requested_at: datetime | None = Field(default=None, description="when it was signed; bounds its life")
    key_id: str | None = Field(default=None, description="the key that signed it (`schemas.replay_auth`)")
    signature: str | None = Field(default=None, description="hex HMAC-SHA256 over the rest of the request")


class AdvertisedLane(Record):
    """A lane a running replayer service answers with: its name and runtime fingerprint's sha256."""

    name: str = Field(min_length=1, max_length=64)
    fingerprint_sha256: Sha256


class ReplayerHeartbeat(Record):
    """A running replayer service says it consumes on-demand requests (the heartbeat topic, keyed by its group).

    Sent when it starts, every ``interval_s`` while it runs, and once with ``stopping`` when it stops cleanly; a
    client takes the service for absent when the newest heartbeat of its group is older than a few intervals.

    ``lane`` and ``lane_fingerprint_sha256`` name its one-at-a-time lane; ``lanes`` every lane it answers with,
    that one and each schedule lane it has built (one per production engine's settings), so a client can tell an
    answer of the service's from a forged one. None, not an empty tuple, when absent: the canonical encoding
    leaves None out, so a heartbeat of a service that predates the field keeps its identity."""

    schema_version: Literal["reprolane.replay/1"] = REPLAY_SCHEMA_VERSION
    group_id: str = Field(min_length=1, max_length=255, description="the service's envelope consumer group")
    lane: str = Field(min_length=1, max_length=64)
    lane_fingerprint_sha256: Sha256
    at: datetime
    interval_s: float = Field(gt=0.0, le=3600.0)
    stopping: bool = False
    lanes: tuple[AdvertisedLane, ...] | None = Field(default=None, max_length=64)

    def answers_with(self, lane_fingerprint_sha256: str) -> bool:
        """Whether this service says it answers with the lane of that fingerprint."""
        advertised = {self.lane_fingerprint_sha256, *(lane.fingerprint_sha256 for lane in self.lanes or ())}
        return lane_fingerprint_sha256 in advertised

    def lane_names(self) -> str:
        """The lanes it advertises, for a message: ``vllm 1a2b3c4d5e6f, schedule 9f8e7d6c5b4a``."""
        lanes = self.lanes or (AdvertisedLane(name=self.lane, fingerprint_sha256=self.lane_fingerprint_sha256),)
        return ", ".join(f"{lane.name} {lane.fingerprint_sha256[:12]}" for lane in lanes)


class ReplayedOutput(Record):
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[StepLogprobs, ...] | None = None
    finish_reason: str | None = None


class StepCandidates(Record):
    """Recorded and replayed top-k at one step, with the top-1/top-2 margin of each."""

    position: int = Field(ge=0)
    recorded_token_id: int | None = None
    replayed_token_id: int | None = None
    recorded_top: tuple[TopCandidate, ...] = ()
    replayed_top: tuple[TopCandidate, ...] = ()
    recorded_margin: float | None = Field(default=None, description="logprob(top1) - logprob(top2)")
    replayed_margin: float | None = None


class FirstDivergence(Record):
    position: int = Field(ge=0, description="index of the first differing generated token")
    at: StepCandidates
    before: StepCandidates | None = Field(default=None, description="the step before the fork")
    near_tie: bool = Field(description="the recorded top-1/top-2 margin at the fork was below the threshold")


class ChoiceCheck(Record):
    """One choice of a request with ``n > 1`` compared with its replay (every choice is a sequence of its own in the
    engine's schedule, with its own seed: vLLM seeds choice ``i`` with the request's seed + ``i``)."""

    index: int = Field(ge=0)
    verdict: Verdict
    target_met: bool
    first_divergence: int | None = Field(default=None, ge=0, description="the first differing token's position")
    token_match_rate: float = Field(ge=0.0, le=1.0)
    cause_hint: CauseHint


class DivergenceEvent(Record):
    schema_version: Literal["reprolane.replay/1"] = REPLAY_SCHEMA_VERSION
    request_id: RequestId
    envelope_id: Sha256
    lane: str
    lane_fingerprint: RuntimeFingerprint
    lane_fingerprint_sha256: Sha256
    fingerprint_diffs: tuple[FieldDiff, ...] = ()
    verdict: Verdict = Field(description="the strictest level that held, or 'diverged' when none did")
    levels_held: tuple[ReproLevel, ...] = Field(
        description="every level that held, strictest first (token and numeric are not ordered: a set, not a rank)"
    )
    target_level: ReproLevel = Field(description="the level the envelope declared")
    target_met: bool = Field(
        description="target_level is among levels_held, unless the recorded sample drew from the worker's global RNG "
        "state, which no replay restores"
    )
    first_divergence: FirstDivergence | None = Field(
        default=None, description="where the token ids part (or the shorter output ends); None when they are identical"
    )
    max_abs_logprob_diff: float | None = Field(
        default=None,
        description="largest chosen-token logprob difference over the common prefix and the fork step (None when "
        "either side has no logprobs, or the window holds no pair of them)",
    )
    max_rel_logprob_diff: float | None = Field(
        default=None, description="the same, relative to the larger of the two magnitudes (floored: `replayer.compare`)"
    )
    token_match_rate: float = Field(
        ge=0.0, le=1.0, description="positions with the same token id / the longer output's length"
    )
    recorded_length: int = Field(ge=0)
    replayed_length: int = Field(ge=0)
    length_diff: int = Field(description="replayed_length - recorded_length")
    semantic_similarity: float | None = None
    cause_hint: CauseHint
    cause_detail: str = ""
    tenant: str = "default"
    workflow_id: str | None = None
    workflow_step: int | None = None
    replayed_at: datetime
    replay_ms: float = Field(ge=0.0)
    reply_to: str | None = None
    schedule_reproduced: bool | None = Field(
        default=None,
        description="schedule lane only: every replayed step had the recorded shapes (None: no schedule replay)",
    )
    schedule_mismatch_step: int | None = Field(
        default=None, description="schedule lane only: the first recorded step whose replayed shapes differ"
    )
    choices: tuple[ChoiceCheck, ...] | None = Field(
        default=None,
        min_length=2,
        description="a request with n > 1 whose every choice was replayed: each choice's comparison, by index (the "
        "event's own verdict and divergence are then those of the choice that held the fewest levels)",
    )
    divergent_choice: int | None = Field(
        default=None, ge=0, description="the first choice (by index) whose replay is not bitwise (None: none, or n = 1)"
    )

    def result_id(self) -> str:
        return replay_result_id(self.envelope_id, self.lane_fingerprint_sha256)


class ReplayResult(Record):
    schema_version: Literal["reprolane.replay/1"] = REPLAY_SCHEMA_VERSION
    event: DivergenceEvent
    replayed: ReplayedOutput


def replay_result_id(envelope_id: str, lane_fingerprint_sha256: str) -> str:
    """Idempotency key of a replay: the same envelope on the same lane is the same result."""
    return sha256_hex(canonical_json({"envelope_id": envelope_id, "lane": lane_fingerprint_sha256}))


def decode_replay_request(data: bytes | str) -> ReplayRequest:
    return decode_record(ReplayRequest, "replay request", data)


def decode_heartbeat(data: bytes | str) -> ReplayerHeartbeat:
    return decode_record(ReplayerHeartbeat, "replayer heartbeat", data)


def decode_divergence(data: bytes | str) -> DivergenceEvent:
    return decode_record(DivergenceEvent, "divergence event", data)


def decode_replay_result(data: bytes | str) -> ReplayResult:
    return decode_record(ReplayResult, "replay result", data)
