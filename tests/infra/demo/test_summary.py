"""The demo's summary: verdict counts, the worst divergences first, workflows' first diverging step (pure)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from infra.demo.summary import DemoFacts, auditor_pick, render_summary, verdict_counts, worst
from infra.demo.workload import Sent
from schemas import DivergenceEvent, FirstDivergence, StepCandidates
from tests.factories import envelope, runtime


def event(request_id: str, verdict: str, *, fork: int | None = None, margin: float = 0.5, **kw: Any) -> DivergenceEvent:
    lane = runtime(max_num_seqs=1, prefix_caching=False)
    first = None
    if fork is not None:
        at = StepCandidates(position=fork, recorded_token_id=1, replayed_token_id=2, recorded_margin=margin)
        first = FirstDivergence(position=fork, at=at, near_tie=margin < 0.1)
    met = verdict in ("bitwise", "token")
    return DivergenceEvent(
        request_id=request_id, envelope_id="e" * 64, lane="vllm", lane_fingerprint=lane,
        lane_fingerprint_sha256=lane.sha256(), verdict=verdict,  # type: ignore[arg-type]
        levels_held=("token",) if met else (), target_level="token", target_met=met, first_divergence=first,
        token_match_rate=1.0 if fork is None else 0.5, recorded_length=8, replayed_length=8, length_diff=0,
        cause_hint="identical" if fork is None else "late_fork_numeric_drift",
        replayed_at=datetime(2026, 11, 29, tzinfo=UTC), replay_ms=12.0, **kw,
    )  # fmt: skip


def sent(rid: str, group: str, workflow: str | None = None, step: int | None = None) -> Sent:
    s = Sent(rid, group, "insurance", f"p-{rid}", None)
    s.workflow, s.step = workflow, step
    return s


def facts() -> DemoFacts:
    requests = [
        sent("r-c01", "alone"),
        sent("r-c02", "12 at once"),
        sent("r-c03", "12 at once"),
        sent("r-c04", "4 at once"),
        sent("r-wf1-s1", "workflow", "claim-triage", 1),
        sent("r-wf1-s2", "workflow", "claim-triage", 2),
    ]
    events = {
        "r-c01": event("r-c01", "bitwise"),
        "r-c02": event("r-c02", "diverged", fork=9),
        "r-c03": event("r-c03", "diverged", fork=3, margin=0.02),
        "r-wf1-s1": event("r-wf1-s1", "bitwise"),
        "r-wf1-s2": event("r-wf1-s2", "diverged", fork=5),
    }
    envelopes = {s.request_id: envelope(request_id=s.request_id) for s in requests}
    return DemoFacts(
        "run-1", requests, envelopes, in_s3=6, events=events, expected=frozenset([*events, "r-c04"]),
        traffic_s=10.0, replay_s=20.0, details={"r-c03": "TOPK-DETAIL\n"},
    )  # fmt: skip


def test_worst_is_earliest_fork_first_and_skips_held_targets() -> None:
    f = facts()
    assert [e.request_id for e in worst(f.events, 5)] == ["r-c03", "r-wf1-s2", "r-c02"]
    assert auditor_pick(f.events) is not None
    assert auditor_pick(f.events).request_id == "r-c03"  # type: ignore[union-attr]
    assert auditor_pick({"r-c01": f.events["r-c01"]}).request_id == "r-c01"  # type: ignore[union-attr]
    assert auditor_pick({}) is None


def test_summary_counts_verdicts_groups_workflows_and_missing_replays() -> None:
    f = facts()
    assert verdict_counts(f.events) == {"bitwise": 2, "diverged": 3}
    text = render_summary(f)
    assert "captured   6/6 envelopes on Kafka, 6/6 in S3" in text
    assert "flagged    6 (header 6, tenant 0, sample 0)" in text
    assert "replayed   5/6" in text
    assert "verdicts   bitwise 2  token 0  numeric 0  diverged 3" in text
    assert "met 2, missed 3" in text
    assert "12 at once  sent  2  replayed  2" in text
    assert "forks at token 3, 9" in text
    assert "first diverging step 2 (token 5)" in text
    assert "1. r-c03 (12 at once" in text
    assert "TOPK-DETAIL" in text
    assert "NOT replayed in time: r-c04" in text


def test_summary_says_which_lane_replayed_how_many() -> None:
    f = facts()
    assert "5 on lane vllm (one sequence at a time)" in render_summary(f)
    f.events["r-c02"] = f.events["r-c02"].model_copy(
        update={"lane": "schedule", "verdict": "bitwise", "schedule_reproduced": True, "first_divergence": None}
    )
    f.events["r-c03"] = f.events["r-c03"].model_copy(
        update={"lane": "schedule", "schedule_reproduced": False, "schedule_mismatch_step": 4}
    )
    text = render_summary(f)
    assert "2 on the schedule lane" in text
    assert "schedule reproduced 1, bitwise 1" in text
    assert "3 on lane vllm (one sequence at a time)" in text
