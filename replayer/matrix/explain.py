"""Explain a fork: re-replay one recorded request under targeted variations and name the one that reproduces it.

`reprolane replay` says *that* a replay diverged from the capture. This module asks *why*, by experiment: it runs
the recorded prompt under a few variations, each changing one dimension, and reports for each whether it
reproduced the **recorded** tokens (token-identical to the captured output), and otherwise where it first
diverged. The conclusion names only variations that reproduced the capture; when none did, it says so.

The variations (each on a fresh engine of its configuration, via `replayer.matrix.execution`):

- ``alone``: the recorded dtype, one sequence at a time, no prefix cache: the deterministic lane's schedule.
- ``batch``: the request submitted at once with the other requests that were in flight when it was captured:
  batch size = max(``context.in_flight_at_start``, ``in_flight_at_end``) (both count the request itself), the
  recorded dtype and prefix-cache setting. The companions are envelopes of the same day (any tenant: the
  sidecar's in-flight count spans tenants; the same sidecar when recorded) captured within ``window_s`` seconds
  (closest first); when there are too few, bundled workload prompts pad the batch,
  and the evidence says how many. Production's staggered arrivals become one simultaneous submission: the batch
  *size* and the companions are recorded facts, the exact step-by-step composition is not.
- ``dtype``: the other dtype (float32 for a bfloat16 capture), alone.
- ``lane.transformers``: another engine (the float32 transformers reference lane), alone.
- ``engine.version``: another vLLM version: only one can be installed here, so it is listed as skipped.
- ``schedule``: when the envelope names the production engine's recorded schedule (issue 22), the request
  replayed inside the batches it ran in (`replayer.schedule.replay`: every recorded step's shapes, filler
  companions). A fork that this replay reproduces **bitwise**, with the schedule reproduced step for step, is
  attributed to batching, with that replay (its event) as the evidence. The caller runs it (it needs the schedule
  store) and passes the result, or why it could not run.

Trust rules: a variation "reproduces" only on token identity with the recorded output (logprob closeness is
reported as evidence, never counted as reproduction); every variation is reported, skipped or failed ones with
the reason; the runtime fingerprint differences between the capture and each variation are listed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Literal

from replayer.compare import compare
from replayer.lanes.batch_engine import EngineConfig, Platform
from replayer.matrix.dimensions import Cell, Schedule
from replayer.matrix.execution import CellJob, CellRun, run_jobs
from replayer.matrix.inputs import MatrixItem, item_from_envelope
from replayer.matrix.results import comparison_fields
from replayer.report import ReportModel
from replayer.settings import Thresholds
from schemas import Envelope, FieldDiff, ReplayResult, StepCandidates, diff_fingerprints

DEFAULT_WINDOW_S: Final = 5.0
VARIATIONS: Final = ("alone", "batch", "dtype", "lane.transformers", "engine.version", "schedule")
_DTYPES: Final = ("bfloat16", "float16", "float32")
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


class VariationOutcome(ReportModel):
    name: str
    dimension: str
    description: str
    engine: str
    status: Literal["ran", "skipped", "failed"]
    reason: str | None = None
    reproduced: bool | None = None
    verdict: str | None = None
    first_divergence: int | None = None
    recorded_length: int | None = None
    replayed_length: int | None = None
    max_abs_logprob_diff: float | None = None
    max_rel_logprob_diff: float | None = None
    before_fork: StepCandidates | None = None
    at_fork: StepCandidates | None = None
    fingerprint_diffs: tuple[FieldDiff, ...] = ()
    batch: tuple[str, ...] = ()
    cause_detail: str = ""
    replayed_text: str | None = None


class Explanation(ReportModel):
    request_id: str
    envelope_id: str
    recorded_dtype: str
    recorded_prefix_caching: bool | None
    in_flight_at_start: int
    in_flight_at_end: int
    batch_size: int
    companions: tuple[str, ...]
    padded_with_workload: int
    notes: tuple[str, ...]
    variations: tuple[VariationOutcome, ...]
    reproducing: tuple[str, ...]
    conclusion: str

    @property
    def exit_code(self) -> int:
        """0 when some variation reproduced the capture, 1 when none did."""
        return 0 if self.reproducing else 1


@dataclass(frozen=True)
class Variation:
    cell: Cell
    items: tuple[MatrixItem, ...]


def select_companions(
    target: Envelope, candidates: Sequence[Envelope], *, count: int, window_s: float
) -> list[Envelope]:
    """Replayable envelopes captured within ``window_s`` of the target, closest first.

    Any tenant: the in-flight count is the sidecar's, across tenants, and so was the server's batch. When both
    envelopes name their sidecar (``context.sidecar_id``), only the target's sidecar counts.
    """
    window = timedelta(seconds=window_s)
    sidecar = target.context.sidecar_id
    near = [
        e
        for e in candidates
        if e.request_id != target.request_id
        and e.replayable
        and abs(e.captured_at - target.captured_at) <= window
        and (sidecar is None or e.context.sidecar_id in (None, sidecar))
    ]
    near.sort(key=lambda e: (abs(e.captured_at - target.captured_at), e.request_id))
    return near[: max(0, count)]


def recorded_batch_size(target: Envelope) -> int:
    return max(1, target.context.in_flight_at_start, target.context.in_flight_at_end)


def plan_variations(
    target: MatrixItem,
    envelope: Envelope,
    companions: Sequence[MatrixItem],
    padding: Sequence[MatrixItem],
    platform: Platform,
) -> list[Variation]:
    """The variations for one request (see module docstring); pure."""
    dtype = envelope.runtime.dtype if envelope.runtime.dtype in _DTYPES else "bfloat16"
    pc = bool(envelope.runtime.prefix_caching)
    single = Schedule("single")
    alone = Cell(
        "alone", "batch", f"alone, {dtype}, no prefix cache: the fixed schedule", EngineConfig(dtype=dtype), single
    )
    out = [Variation(alone, (target,))]
    size = recorded_batch_size(envelope)
    others = (*companions, *padding)
    recorded = sorted((target, *companions), key=lambda i: (i.captured_at or _EPOCH, i.request_id))
    batch_items = (*recorded, *padding)
    batch = Cell(
        "batch",
        "batch",
        f"at once with {len(others)} other request(s) (recorded in flight: {size}), {dtype}, prefix cache "
        + ("on" if pc else "off"),
        EngineConfig(dtype=dtype, prefix_caching=pc),
        Schedule("all"),
        None if size > 1 else "the capture recorded no other request in flight: it ran alone",
    )
    out.append(Variation(batch, batch_items))
    other = "float32" if dtype != "float32" else "bfloat16"
    out.append(Variation(Cell("dtype", "dtype", f"alone, {other}", EngineConfig(dtype=other), single), (target,)))
    lane = Cell(
        "lane.transformers",
        "engine",
        "alone, transformers float32 reference lane (another engine)",
        EngineConfig(engine="transformers", dtype="float32", threads=1),
        single,
        None if platform.transformers_version else "transformers is not installed (lanes extra)",
    )
    out.append(Variation(lane, (target,)))
    version = Cell(
        "engine.version",
        "engine",
        "another vLLM version",
        EngineConfig(dtype=dtype),
        single,
        f"only one vLLM version is installed here ({platform.vllm_version}); the capture ran "
        f"{envelope.runtime.engine} {envelope.runtime.engine_version}",
    )
    out.append(Variation(version, (target,)))
    return out


def judge(
    variation: Variation, run: CellRun | None, target: MatrixItem, envelope: Envelope, th: Thresholds
) -> VariationOutcome:
    """One variation's output against the *recorded* output of the target."""
    cell = variation.cell
    head: dict[str, Any] = {
        "name": cell.name,
        "dimension": cell.dimension,
        "description": cell.description,
        "engine": cell.engine.key,
        "batch": tuple(i.request_id for i in variation.items),
    }
    if not cell.runnable:
        return VariationOutcome(**head, status="skipped", reason=cell.skip_reason)
    out = run.outputs.get(target.request_id) if run is not None and not run.error else None
    if out is None or target.recorded is None:
        return VariationOutcome(**head, status="failed", reason=(run.error if run else None) or "no output")
    diffs = diff_fingerprints(envelope.runtime, run.fingerprint) if run and run.fingerprint else ()
    cmp = compare(target.recorded, out, th, "token", fingerprint_diffs=diffs)
    return VariationOutcome(
        **head,
        **comparison_fields(cmp),
        recorded_length=cmp.recorded_length,
        replayed_length=cmp.replayed_length,
        status="ran",
        reproduced="token" in cmp.levels_held,
        fingerprint_diffs=tuple(diffs),
        replayed_text=out.text,
    )


def schedule_outcome(answer: ReplayResult | str) -> VariationOutcome:
    """The ``schedule`` variation from a schedule replay's result, or skipped with the reason it did not run."""
    head: dict[str, Any] = {
        "name": "schedule",
        "dimension": "batching",
        "description": "inside the batches it ran in: vLLM's recorded schedule, filler companions",
        "engine": "vllm.schedule",
    }
    if isinstance(answer, str):
        return VariationOutcome(**head, status="skipped", reason=answer)
    ev = answer.event
    return VariationOutcome(
        **head,
        **comparison_fields(ev),
        recorded_length=ev.recorded_length,
        replayed_length=ev.replayed_length,
        status="ran",
        reproduced="token" in ev.levels_held and ev.schedule_reproduced is True,
        fingerprint_diffs=ev.fingerprint_diffs,
        replayed_text=answer.replayed.text,
    )


def conclude(outcomes: Sequence[VariationOutcome]) -> tuple[tuple[str, ...], str]:
    """(names of the variations that reproduced the capture, the conclusion in words)."""
    ran = [o for o in outcomes if o.status == "ran"]
    sched = next((o for o in ran if o.name == "schedule" and o.reproduced and o.verdict == "bitwise"), None)
    alone_run = next((o for o in ran if o.name == "alone"), None)
    if sched is not None and (alone_run is None or alone_run.verdict != "bitwise"):
        return (sched.name, *(o.name for o in ran if o.reproduced and o is not sched)), (
            "attributed to batching: replayed inside the batches it ran in (the recorded schedule, step for step, "
            "filler companions) the request reproduces its capture bitwise"
            + (f", while alone it is {alone_run.verdict}" if alone_run is not None else "")
            + f". Evidence: the schedule replay ({sched.cause_detail})"
        )
    hits = tuple(o.name for o in ran if o.reproduced)
    misses = [o for o in ran if not o.reproduced]
    miss_text = "; ".join(f"{o.name} diverges at token {o.first_divergence}" for o in misses)
    if not hits:
        if not ran:
            return hits, "no variation could run here, so nothing was reproduced"
        best = max(ran, key=lambda o: o.first_divergence if o.first_divergence is not None else -1)
        return hits, (
            f"no variation reproduced the recorded output ({miss_text}); the closest was {best.name} "
            f"(identical for the first {best.first_divergence} tokens). The cause lies outside what was varied "
            "here (exact batch composition and arrival timing, engine version, hardware)"
        )
    named = ", ".join(f"{o.name} ({o.description})" for o in ran if o.reproduced)
    if "alone" in hits:
        text = (
            f"the fixed schedule reproduces the recorded tokens ({named}): the token output does not depend on the "
            "dimensions varied here; if a replay reported a divergence for it, compare that lane's fingerprint "
            "with the alone variation's"
        )
    else:
        dims = ", ".join(dict.fromkeys(o.dimension for o in ran if o.reproduced))
        text = f"reproduced by {named}: dimension(s) {dims}. Not reproduced alone or otherwise ({miss_text})"
    bitwise = [o for o in ran if o.verdict == "bitwise"]
    alone = next((o for o in ran if o.name == "alone"), None)
    if bitwise and alone is not None and alone.verdict != "bitwise":
        drift = f"{alone.max_abs_logprob_diff:.3g}" if alone.max_abs_logprob_diff is not None else "unknown"
        names = ", ".join(o.name for o in bitwise)
        text += (
            f". The recorded logprobs are reproduced bitwise only by {names} (alone differs by max |dlogprob| "
            f"{drift}): the capture's numerics match {names}"
        )
    return hits, text


def explain(
    envelope: Envelope,
    candidates: Sequence[Envelope],
    *,
    model_dir: Path,
    platform: Platform,
    padding_factory: Callable[[int], list[MatrixItem]],
    window_s: float = DEFAULT_WINDOW_S,
    thresholds: Thresholds | None = None,
    only: Sequence[str] | None = None,
    notes: Sequence[str] = (),
    progress: bool = False,
    schedule: ReplayResult | str | None = None,
) -> Explanation:
    """Run the variations for ``envelope`` (``candidates``: envelopes to pick companions from) and conclude.

    ``only`` restricts the run to the named variations (all by default; the note says when it was restricted);
    ``notes`` are the caller's remarks on the evidence (e.g. stored objects that could not be read);
    ``schedule``: the schedule replay's result (or why it could not run), the ``schedule`` variation.

    Raises ValueError when the envelope cannot be replayed (the reason in the message).
    """
    target = item_from_envelope(envelope)
    size = recorded_batch_size(envelope)
    chosen = select_companions(envelope, candidates, count=size - 1, window_s=window_s)
    companions = [item_from_envelope(e) for e in chosen]
    n_pad = max(0, size - 1 - len(companions))
    padding = padding_factory(n_pad) if n_pad else []
    notes = list(notes)
    if n_pad:
        notes.append(
            f"only {len(companions)} recorded request(s) captured within {window_s:g} s; the batch was padded with "
            f"{n_pad} bundled workload prompt(s)"
        )
    if not envelope.sampling or envelope.sampling.unseeded:
        notes.append("the capture sampled from the worker's global RNG: token identity cannot be expected anywhere")
    notes.append("the batch variation submits its requests at once; production's arrival timing is not reproduced")
    variations = plan_variations(target, envelope, companions, padding, platform)
    if only is not None:
        unknown = sorted(set(only) - {v.cell.name for v in variations} - {"schedule"})
        if unknown:
            raise ValueError(f"unknown variation(s) {', '.join(unknown)}; known: {', '.join(VARIATIONS)}")
        variations = [v for v in variations if v.cell.name in only]
        notes.append(f"only these variations were asked for: {', '.join(only)}")
    runs = run_jobs(model_dir, [CellJob(v.cell, v.items) for v in variations], progress=progress)
    th = thresholds or Thresholds()
    outcomes = tuple(judge(v, runs.get(v.cell.name), target, envelope, th) for v in variations)
    if schedule is not None:
        outcomes = (*outcomes, schedule_outcome(schedule))
    hits, conclusion = conclude(outcomes)
    return Explanation(
        request_id=envelope.request_id,
        envelope_id=envelope.envelope_id(),
        recorded_dtype=envelope.runtime.dtype or "unknown",
        recorded_prefix_caching=envelope.runtime.prefix_caching,
        in_flight_at_start=envelope.context.in_flight_at_start,
        in_flight_at_end=envelope.context.in_flight_at_end,
        batch_size=size,
        companions=tuple(c.request_id for c in companions),
        padded_with_workload=n_pad,
        notes=tuple(notes),
        variations=outcomes,
        reproducing=hits,
        conclusion=conclusion,
    )


def render_explanation(ex: Explanation) -> str:
    """Terminal text: one line per variation, then the conclusion."""
    lines = [
        f"explain {ex.request_id}: recorded {ex.recorded_dtype}, prefix cache {ex.recorded_prefix_caching}, "
        f"in flight {ex.in_flight_at_start} at start / {ex.in_flight_at_end} at end -> batch of {ex.batch_size}",
        f"companions: {', '.join(ex.companions) or 'none'}; padded with {ex.padded_with_workload} workload prompt(s)",
    ]
    for o in ex.variations:
        if o.status != "ran":
            lines.append(f"  {o.name:<18} {o.status}: {o.reason}")
            continue
        what = "REPRODUCES the recorded tokens" if o.reproduced else f"diverges at token {o.first_divergence}"
        lp = f"max |dlogprob| {o.max_abs_logprob_diff:.3g}" if o.max_abs_logprob_diff is not None else "no logprobs"
        lines.append(f"  {o.name:<18} {what} ({o.verdict}; {lp}) - {o.description}")
        if o.at_fork is not None:
            rec = ", ".join(f"{c.token_id}:{c.logprob:.3f}" for c in o.at_fork.recorded_top[:3])
            rep = ", ".join(f"{c.token_id}:{c.logprob:.3f}" for c in o.at_fork.replayed_top[:3])
            lines.append(f"  {'':<18} at the fork: recorded top [{rec}] vs this variation [{rep}]")
    lines += [f"note: {n}" for n in ex.notes]
    lines.append(f"conclusion: {ex.conclusion}")
    return "\n".join(lines)
