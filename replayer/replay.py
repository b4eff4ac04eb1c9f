"""One envelope through one lane into a `schemas.ReplayResult`.

`replay_envelope` checks that the envelope can be replayed, runs choice 0's prompt token ids and sampling
contract on the lane, compares the outputs (`replayer.compare`), diffs the runtime fingerprints and returns the
result with its `schemas.DivergenceEvent`. It is blocking (the lane is); the service runs it in a worker thread.

Choices made here:

- **Length.** The replay runs with the contract's ``max_tokens``, capped at the recorded length +
  `EXTRA_TOKENS`: a replay that would run past where the recording stopped shows up as a length difference,
  while a contract of 4096 tokens never makes a 10-token recording cost 4096 steps. Without a contract
  ``max_tokens`` the cap itself is used.
- **Top-k.** The replay asks for the contract's ``logprobs`` (the k the capture recorded), else the widest
  top-k list seen in the recording, else 0 (chosen-token logprobs only).
- **Seed scope.** ``per_request`` seeds replay exactly (the lanes pass the seed to a per-request generator).
  ``worker_global`` randomness cannot be replayed token for token: the lane samples without a seed and a
  sampled (non-greedy) replay of such a request is reported with ``target_met = False`` whatever the outputs, and
  one that differs gets its own cause, ``unseeded_sampling`` (never a forward-pass one), naming the field and the
  remedy (`UNSEEDED_DETAIL`).
- **The endpoint's view of the alternatives.** A vLLM server answers a step's alternatives from the engine's
  logprob dict (the sampled token first, then the top-k ranks; k + 1 entries when the sampled token is not among
  them). The chat and responses servers list its first k entries, so a sampled token outside the top-k is listed
  and the k-th rank is not; the completions server lists all of it. In-process lanes return the whole dict, and
  `server_view` takes the recorded endpoint's view of it, so a replay is compared on what production's server
  would have answered.
- **Only choice 0** is replayed (it answers the first prompt); for ``n > 1`` and for a completions request with
  several prompts (``more_prompts``) the detail says so.
- **LoRA adapters.** The adapter a request ran with (`recorded_adapter`) goes to the lane, which loads its own copy
  only when that copy's digest is the recorded one, and refuses otherwise (`replayer.lanes.adapters`).
- **Semantic similarity** is computed only when ``settings.semantic`` is on and the texts differ (identical
  texts score 1.0 without a model); see `replayer.semantic`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Final

from replayer.compare import compare
from replayer.errors import NotReplayableError
from replayer.lanes.adapters import Adapter
from replayer.lanes.base import GenRequest, Lane
from replayer.settings import ReplayerSettings
from replayer.tool_calls import fork_in_tool_call
from schemas import (
    CapturedOutput,
    Choice,
    DivergenceEvent,
    Envelope,
    ReplayedOutput,
    ReplayResult,
    RuntimeFingerprint,
    SamplingContract,
    diff_fingerprints,
)

__all__ = [
    "EXTRA_TOKENS",
    "FROM_COMPARISON",
    "gen_request",
    "recorded_adapter",
    "replay_budget",
    "replay_envelope",
    "server_view",
]

#: How many tokens past the recorded length a replay may run (bounds cost; still shows length differences).
EXTRA_TOKENS: Final = 16
#: Endpoints whose answers list the first k entries of a step's logprob dict (see the module docstring).
FIRST_K_ENDPOINTS: Final = frozenset({"chat.completions", "responses"})
#: The members of a comparison (`replayer.compare.Comparison`) that are the divergence event's own, under the same
#: names; the event's ``target_met``, ``cause_hint`` and ``cause_detail`` are the comparison's with this envelope's
#: notes applied.
FROM_COMPARISON: Final = (
    *("verdict", "levels_held", "first_divergence", "max_abs_logprob_diff", "max_rel_logprob_diff"),
    *("token_match_rate", "recorded_length", "replayed_length", "length_diff", "semantic_similarity"),
)
#: The words of an ``unseeded_sampling`` cause (`schemas.replay.CauseHint`): the field, and the remedy.
UNSEEDED_DETAIL: Final = (
    "sampling.seed: the request was sampled without a per-request seed (seed scope worker_global), so its tokens "
    "came from the worker's global random state, which no replay restores; run the capture sidecar with "
    "--inject-seed to make sampled requests replayable"
)


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _choice0(envelope: Envelope) -> tuple[tuple[int, ...], SamplingContract, Choice]:
    """The prompt ids, contract and recorded choice 0, or `NotReplayableError` saying what is missing."""
    rid = envelope.request_id
    if not isinstance(envelope.outcome, CapturedOutput):
        err = envelope.outcome
        raise NotReplayableError(
            f"{rid}: the request ended in an error ({err.error_type}: {err.message}); no complete output to compare"
        )
    if envelope.prompt is None:
        raise NotReplayableError(f"{rid}: no prompt token ids were recorded (the request never reached a tokenizer)")
    if envelope.sampling is None:
        raise NotReplayableError(f"{rid}: no sampling contract was recorded (the request was rejected as invalid)")
    choices = [c for c in envelope.outcome.choices if c.index == 0]
    if not choices:
        raise NotReplayableError(f"{rid}: the recorded output has no choice with index 0")
    return envelope.prompt.token_ids, envelope.sampling, choices[0]


def replay_budget(sampling: SamplingContract, recorded: Choice) -> tuple[int, int]:
    """(max_tokens, top_k_logprobs) for replaying ``recorded`` under ``sampling`` (see the module docstring)."""
    cap = len(recorded.token_ids) + EXTRA_TOKENS
    max_tokens = min(sampling.max_tokens, cap) if sampling.max_tokens is not None else cap
    if sampling.logprobs is not None:
        top_k = sampling.logprobs
    elif recorded.logprobs:
        top_k = max(len(s.top) for s in recorded.logprobs)
    else:
        top_k = 0
    return max(1, max_tokens), min(top_k, 20)


def _check_constraint_backend(envelope: Envelope, lane_fp: RuntimeFingerprint) -> None:
    """Refuse a constrained request (structured outputs, a required or named tool choice) on a lane whose
    structured-output backend or grammar library versions differ from production's: they build the token mask, and
    a different one can allow different tokens. Unknown on either side is not refused (and not evidence)."""
    sampling = envelope.sampling
    if sampling is None or sampling.constraint is None or not sampling.constraint.constrains:
        return
    recorded, replay = envelope.runtime.structured_outputs, lane_fp.structured_outputs
    if recorded is not None and replay is not None and recorded != replay:
        raise NotReplayableError(
            f"{envelope.request_id}: runtime.structured_outputs differs ({recorded!r} recorded, {replay!r} on this "
            f"lane): the token mask of {', '.join(sampling.constraint.named())} may allow other tokens"
        )


def recorded_adapter(envelope: Envelope, settings: ReplayerSettings) -> Adapter | None:
    """The LoRA adapter the request ran with (`schemas.ArtifactHashes`), None for the base model. An envelope whose
    ``model`` is the name of an adapter this replayer has, but which records none (its sidecar was not told upstream
    serves it), is refused: replaying it on the base model would compare another computation."""
    arts = envelope.artifacts
    if arts.adapter_name is not None and arts.adapter_sha256 is not None:
        return Adapter(arts.adapter_name, arts.adapter_sha256)
    if envelope.model in settings.lora_modules:
        raise NotReplayableError(
            f"{envelope.request_id}: artifacts.adapter_sha256: the request named {envelope.model!r}, a LoRA adapter "
            "here, but its envelope records no adapter (run the capture sidecar with --lora-module NAME=PATH as "
            "upstream's --lora-modules)"
        )
    return None


def server_view(replayed: ReplayedOutput, endpoint: str, k: int) -> ReplayedOutput:
    """``replayed`` with each step's alternatives cut to what ``endpoint``'s server lists (module docstring)."""
    if replayed.logprobs is None or endpoint not in FIRST_K_ENDPOINTS:
        return replayed
    if all(len(step.top) <= k for step in replayed.logprobs):
        return replayed
    steps = tuple(s if len(s.top) <= k else s.model_copy(update={"top": s.top[:k]}) for s in replayed.logprobs)
    return replayed.model_copy(update={"logprobs": steps})


def gen_request(envelope: Envelope, lane_fp: RuntimeFingerprint, settings: ReplayerSettings) -> GenRequest:
    """What a lane of fingerprint ``lane_fp`` runs to replay choice 0 of ``envelope`` (its prompt ids, contract,
    length and top-k budget, tool-call parser and adapter), or `NotReplayableError` saying why it cannot."""
    prompt_ids, sampling, recorded = _choice0(envelope)
    max_tokens, top_k = replay_budget(sampling, recorded)
    _check_constraint_backend(envelope, lane_fp)
    adapter = recorded_adapter(envelope, settings)
    parser = envelope.runtime.tool_call_parser
    return GenRequest(
        prompt_ids, sampling, max_tokens=max_tokens, top_k_logprobs=top_k, tool_call_parser=parser, adapter=adapter
    )


def replay_envelope(
    envelope: Envelope,
    lane: Lane,
    settings: ReplayerSettings,
    *,
    now: Callable[[], datetime] = _utcnow,
    reply_to: str | None = None,
    every_choice: bool = False,
) -> ReplayResult:
    """Replay choice 0 of ``envelope`` on ``lane`` and compare; raises `NotReplayableError` (says why).
    ``every_choice``: the lane replays every choice of a request with ``n > 1`` (the schedule lane; its caller
    compares the others), so the event does not say that only choice 0 was.

    A divergence is a result: every replay returns a `ReplayResult` whose event carries the verdict.
    `LaneUnavailableError` (and the lane's own errors) propagate.
    """
    _, sampling, recorded = _choice0(envelope)
    lane_fp = lane.fingerprint()
    request = gen_request(envelope, lane_fp, settings)
    top_k = request.top_k_logprobs
    started = time.perf_counter()
    replayed = lane.replay(request)
    replay_ms = (time.perf_counter() - started) * 1e3
    replayed = server_view(replayed, envelope.endpoint, top_k)

    similarity: float | None = None
    if settings.semantic:
        if recorded.text == replayed.text:
            similarity = 1.0
        else:
            from replayer.semantic import similarity as text_similarity

            similarity = text_similarity(recorded.text, replayed.text)

    diffs = diff_fingerprints(envelope.runtime, lane_fp)
    result = compare(
        recorded,
        replayed,
        settings.thresholds,
        envelope.target_level,
        fingerprint_diffs=diffs,
        semantic_similarity=similarity,
    )
    notes: list[str] = []
    target_met, cause_hint, cause_detail = result.target_met, result.cause_hint, result.cause_detail
    if sampling.unseeded:
        target_met = False
        if cause_hint != "identical":  # nothing fixed the random state: not an input or forward-pass difference
            cause_hint, cause_detail = "unseeded_sampling", UNSEEDED_DETAIL + "; " + cause_detail
        else:
            notes.append(UNSEEDED_DETAIL)
    if result.first_divergence is not None and (where := fork_in_tool_call(recorded, result.first_divergence.position)):
        notes.append(where)
    if sampling.n > 1 and not every_choice:
        notes.append(f"n={sampling.n}: only choice 0 was replayed")
    if envelope.more_prompts:
        notes.append(f"{1 + len(envelope.more_prompts)} prompts: only the first prompt's choice 0 was replayed")
    detail = "; ".join([cause_detail, *notes]) if notes else cause_detail

    workflow = envelope.workflow
    event = DivergenceEvent(
        request_id=envelope.request_id,
        envelope_id=envelope.envelope_id(),
        lane=lane.name,
        lane_fingerprint=lane_fp,
        lane_fingerprint_sha256=lane_fp.sha256(),
        fingerprint_diffs=diffs,
        **{name: getattr(result, name) for name in FROM_COMPARISON},
        cause_hint=cause_hint,
        target_level=envelope.target_level,
        target_met=target_met,
        cause_detail=detail,
        tenant=envelope.tenant,
        workflow_id=workflow.workflow_id if workflow is not None else None,
        workflow_step=workflow.step if workflow is not None else None,
        replayed_at=now(),
        replay_ms=replay_ms,
        reply_to=reply_to,
    )
    return ReplayResult(event=event, replayed=replayed)
