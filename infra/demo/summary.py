"""The demo's summary: what was captured, what was replayed, the verdicts, and the worst divergences.

Pure: takes what the demo sent and what it read back from Kafka and S3 (`DemoFacts`), returns text. The detail
of each worst divergence (top-k side by side at the fork, both texts with the fork marked) is the replayer's own
rendering (`replayer.report.render_divergence`), passed in by the caller.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from infra.demo.workload import Sent
from schemas import DivergenceEvent, Envelope

VERDICTS = ("bitwise", "token", "numeric", "semantic", "diverged")
GROUP_ORDER = ("alone", "4 at once", "12 at once", "workflow", "agent")


@dataclass
class DemoFacts:
    run_id: str
    sent: Sequence[Sent]
    envelopes: Mapping[str, Envelope]  # request id -> envelope read back from Kafka
    in_s3: int  # of those, how many the S3 request-id index resolves
    events: Mapping[str, DivergenceEvent]  # request id -> divergence event read back from Kafka
    expected: frozenset[str]  # request ids flagged and replayable: each should get an event
    traffic_s: float
    replay_s: float
    lane: str = "vllm"
    details: Mapping[str, str] = field(default_factory=dict)  # request id -> render_divergence text


def verdict_counts(events: Mapping[str, DivergenceEvent]) -> Counter[str]:
    return Counter(ev.verdict for ev in events.values())


def _verdict_line(counts: Counter[str]) -> str:
    shown = [v for v in VERDICTS if counts[v] or v != "semantic"]
    return "  ".join(f"{v} {counts[v]}" for v in shown)


def worst(events: Mapping[str, DivergenceEvent], n: int) -> list[DivergenceEvent]:
    """Replays whose target did not hold, earliest fork first (a confident flip before a near tie)."""
    missed = [ev for ev in events.values() if not ev.target_met and ev.first_divergence is not None]

    def key(ev: DivergenceEvent) -> tuple[int, float, str]:
        first = ev.first_divergence
        assert first is not None
        margin = first.at.recorded_margin
        return (first.position, -(margin if margin is not None else 0.0), ev.request_id)

    return sorted(missed, key=key)[:n]


def auditor_pick(events: Mapping[str, DivergenceEvent]) -> DivergenceEvent | None:
    """The request the auditor replays: the worst divergence, else any replayed request."""
    top = worst(events, 1)
    if top:
        return top[0]
    return min(events.values(), key=lambda ev: ev.request_id, default=None)


def _group_rows(sent: Sequence[Sent], events: Mapping[str, DivergenceEvent]) -> list[str]:
    rows = []
    for group in GROUP_ORDER:
        ids = [s.request_id for s in sent if s.group == group]
        if not ids:
            continue
        replayed = [events[i] for i in ids if i in events]
        counts = verdict_counts({e.request_id: e for e in replayed})
        forks = sorted(e.first_divergence.position for e in replayed if e.first_divergence is not None)
        fork = f"  forks at token {', '.join(map(str, forks[:6]))}{'…' if len(forks) > 6 else ''}" if forks else ""
        rows.append(f"    {group:<11} sent {len(ids):>2}  replayed {len(replayed):>2}   {_verdict_line(counts)}{fork}")
    return rows


def _workflow_rows(sent: Sequence[Sent], events: Mapping[str, DivergenceEvent]) -> list[str]:
    rows = []
    names = list(dict.fromkeys(s.workflow for s in sent if s.workflow is not None))
    for name in names:
        steps = [s for s in sent if s.workflow == name]
        workflow_id = steps[0].workflow_id or "-"
        verdicts = " ".join(f"{s.step}:{events[s.request_id].verdict}" if s.request_id in events else f"{s.step}:-"
                            for s in steps)  # fmt: skip
        first = next((s for s in steps if s.request_id in events and not events[s.request_id].target_met), None)
        if first is None:
            where = "every step met its target"
        else:
            fd = events[first.request_id].first_divergence
            where = f"first diverging step {first.step}" + (f" (token {fd.position})" if fd is not None else "")
        calls = [c["function"]["name"] for s in steps for c in s.tool_calls]
        where += f"; tool calls run: {', '.join(calls)}" if calls else ""
        rows.append(f"    {name:<14} {workflow_id}  {len(steps)} steps  [{verdicts}]  {where}")
    return rows


def _lane_rows(lane: str, events: Mapping[str, DivergenceEvent]) -> list[str]:
    """Which lane replayed how many: the schedule lane (the recorded batches rebuilt around the request, issue 22)
    for captures whose schedule was found, the one-at-a-time lane for the rest."""
    scheduled = [e for e in events.values() if e.schedule_reproduced is not None]
    rows = []
    if scheduled:
        reproduced = [e for e in scheduled if e.schedule_reproduced]
        bitwise = sum(1 for e in reproduced if e.verdict == "bitwise")
        rows.append(
            f"             {len(scheduled)} on the schedule lane (the batches they ran in, rebuilt from vLLM's"
            f" recorded schedule): schedule reproduced {len(reproduced)}, bitwise {bitwise}"
        )
    alone = len(events) - len(scheduled)
    if alone or not scheduled:
        rows.append(f"             {alone} on lane {lane} (one sequence at a time)")
    return rows


def render_summary(facts: DemoFacts, *, worst_n: int = 3) -> str:
    sent, envelopes, events = facts.sent, facts.envelopes, facts.events
    chats = sum(1 for s in sent if s.workflow is None)
    failed = sum(1 for s in sent if s.error)
    flags = Counter(e.flag_reason for e in envelopes.values() if e.flagged)
    replayed = [rid for rid in facts.expected if rid in events]
    counts = verdict_counts(events)
    met = sum(1 for e in events.values() if e.target_met)
    targets = sorted({e.target_level for e in events.values()}) or ["token"]
    lines = [
        f"Run {facts.run_id}",
        f"  sent       {len(sent)} requests through the capture sidecar in {facts.traffic_s:.1f} s"
        f" ({chats} chat prompts in waves sent alone, 4 and 12 at once; {len(sent) - chats} workflow steps)"
        + (f"; {failed} failed" if failed else ""),
        f"  captured   {len(envelopes)}/{len(sent)} envelopes on Kafka, {facts.in_s3}/{len(sent)} in S3 (Object Lock)",
        f"  flagged    {sum(flags.values())} (header {flags['header']}, tenant {flags['tenant']},"
        f" sample {flags['sample']})",
        f"  replayed   {len(replayed)}/{len(facts.expected)} in {facts.replay_s:.1f} s after the last request",
        *_lane_rows(facts.lane, events),
        f"  verdicts   {_verdict_line(counts)}",
        f"  target     {'/'.join(targets)} level met {met}, missed {len(events) - met}",
        "  by how the request was sent (production lane: vLLM CPU, dynamic batching, bfloat16):",
        *_group_rows(sent, events),
    ]
    wf_rows = _workflow_rows(sent, events)
    if wf_rows:
        lines += ["  workflows (each step built from the previous step's live answer):", *wf_rows]
    top = worst(events, worst_n)
    if top:
        lines.append(f"  worst divergences (earliest fork first; {len(top)} of {len(events) - met}):")
    by_id = {s.request_id: s for s in sent}
    for i, ev in enumerate(top, start=1):
        s = by_id.get(ev.request_id)
        how = f"{s.group}, tenant {s.tenant}, prompt {s.prompt_id}" if s is not None else ev.tenant
        if s is not None and s.client_request_id != s.request_id:
            how += f", X-Request-Id {s.client_request_id}"
        lines.append("")
        lines.append(f"  {i}. {ev.request_id} ({how}): {ev.verdict}, cause {ev.cause_hint}")
        detail = facts.details.get(ev.request_id, "")
        lines.extend(f"     {line}" for line in detail.rstrip("\n").splitlines())
    missing = sorted(facts.expected - set(events))
    if missing:
        lines.append(f"  NOT replayed in time: {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}")
    return "\n".join(lines) + "\n"
