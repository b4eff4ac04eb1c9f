"""`reprolane replay explain` without a model: companions, the variations planned, judging and the conclusion."""

from __future__ import annotations

from datetime import timedelta

import pytest

from replayer.lanes.batch_engine import Platform
from replayer.matrix.execution import CellRun
from replayer.matrix.explain import (
    Explanation,
    Variation,
    conclude,
    judge,
    plan_variations,
    recorded_batch_size,
    render_explanation,
    schedule_outcome,
    select_companions,
)
from replayer.matrix.inputs import item_from_envelope, workload_items
from replayer.settings import Thresholds
from schemas import CapturedError, ExecutionContext, ReplayedOutput, Timings
from tests import factories
from tests.replayer.support import make_envelope
from tests.replayer.test_store import replay_result

CPU = Platform(gpu_count=0, cpu_count=2, vllm_version="0.32.0", transformers_version="5.19.0")
T0 = factories.FIXED_TIME


def _env(rid: str, dt_s: float = 0.0, **kw: object) -> object:
    return factories.envelope(request_id=rid, captured_at=T0 + timedelta(seconds=dt_s), **kw)


def test_companions_any_tenant_same_sidecar_within_window_closest_first() -> None:
    ctx = ExecutionContext(in_flight_at_start=4, in_flight_at_end=2, sidecar_id="sc-1")
    target = factories.envelope(request_id="t", context=ctx)
    elsewhere = ExecutionContext(in_flight_at_start=1, in_flight_at_end=1, sidecar_id="sc-2")
    err = CapturedError(error_type="timeout", message="x", timings=Timings(received_at=T0, upstream_ms=1.0))
    cands = [
        target,
        _env("far", 30.0),
        _env("near", 0.5),
        _env("mid", -2.0),
        _env("other-tenant", 0.1, tenant="someone-else"),
        _env("other-sidecar", 0.05, context=elsewhere),
        _env("failed", 0.2, outcome=err),
        _env("edge", 5.0),
    ]
    chosen = select_companions(target, cands, count=3, window_s=5.0)  # type: ignore[arg-type]
    assert [e.request_id for e in chosen] == ["other-tenant", "near", "mid"]
    assert select_companions(target, cands, count=0, window_s=5.0) == []  # type: ignore[arg-type]
    assert recorded_batch_size(target) == 4


def _plan(in_flight: int = 3, **runtime: object) -> tuple[list[Variation], object]:
    env = factories.envelope(
        runtime=factories.runtime(**runtime),
        context=ExecutionContext(in_flight_at_start=in_flight, in_flight_at_end=1),
    )
    target = item_from_envelope(env)
    comp = item_from_envelope(factories.envelope(request_id="c1", captured_at=T0 - timedelta(seconds=1)))
    pad = workload_items([(1, 2, 3)], max_tokens=8, prefix="padding")
    return plan_variations(target, env, [comp], pad, CPU), env


def test_variations_follow_the_recorded_runtime() -> None:
    variations, _ = _plan(dtype="bfloat16", prefix_caching=True)
    by = {v.cell.name: v for v in variations}
    assert list(by) == ["alone", "batch", "dtype", "lane.transformers", "engine.version"]
    assert by["alone"].cell.engine.dtype == "bfloat16"
    assert not by["alone"].cell.engine.prefix_caching
    assert by["alone"].cell.schedule.mode == "single"
    assert [i.request_id for i in by["alone"].items] == ["req-20260714-001"]
    batch = by["batch"]
    assert batch.cell.engine.prefix_caching  # as recorded
    assert batch.cell.schedule.mode == "all"
    assert [i.request_id for i in batch.items] == ["c1", "req-20260714-001", "padding-000"]  # capture order, pad last
    assert by["dtype"].cell.engine.dtype == "float32"
    assert by["lane.transformers"].cell.engine.engine == "transformers"
    assert "0.32.0" in (by["engine.version"].cell.skip_reason or "")


def test_batch_variation_skipped_when_capture_ran_alone() -> None:
    variations, _ = _plan(in_flight=1)
    batch = next(v for v in variations if v.cell.name == "batch")
    assert "alone" in (batch.cell.skip_reason or "")


def _judge(output: ReplayedOutput, name: str = "batch") -> object:
    variations, env = _plan()
    v = next(x for x in variations if x.cell.name == name)
    target = v.items[1] if name == "batch" else v.items[0]
    run = CellRun(name, {target.request_id: output}, fingerprint=factories.runtime(max_num_seqs=256))
    return judge(v, run, target, env, Thresholds())  # type: ignore[arg-type]


def test_judge_reproduction_is_token_identity_with_the_recording() -> None:
    rec = factories.envelope().outcome.choices[0]  # type: ignore[union-attr]
    same = _judge(ReplayedOutput(token_ids=rec.token_ids, text=rec.text, logprobs=rec.logprobs))
    assert same.reproduced is True  # type: ignore[attr-defined]
    assert same.first_divergence is None  # type: ignore[attr-defined]
    assert [d.field for d in same.fingerprint_diffs] == []  # type: ignore[attr-defined]
    forked = _judge(ReplayedOutput(token_ids=(504, 9, 2), text="y", logprobs=None))
    assert forked.reproduced is False  # type: ignore[attr-defined]
    assert forked.first_divergence == 1  # type: ignore[attr-defined]
    assert forked.at_fork is not None  # type: ignore[attr-defined]


def test_judge_reports_failed_and_skipped_variations() -> None:
    variations, env = _plan()
    v = variations[0]
    failed = judge(v, CellRun("alone", error="vLLM refused"), v.items[0], env, Thresholds())  # type: ignore[arg-type]
    assert (failed.status, failed.reason, failed.reproduced) == ("failed", "vLLM refused", None)
    skipped = judge(variations[-1], None, v.items[0], env, Thresholds())  # type: ignore[arg-type]
    assert skipped.status == "skipped"


def _outcomes(bitwise: tuple[str, ...] = (), **reproduced: bool | None) -> list[object]:
    variations, env = _plan()
    rec = factories.envelope().outcome.choices[0]  # type: ignore[union-attr]
    out = []
    for v in variations:
        flag = reproduced.get(v.cell.name.replace(".", "_"))
        target = v.items[1] if v.cell.name == "batch" else v.items[0]
        if flag is None:
            out.append(judge(v, None, target, env, Thresholds()))  # type: ignore[arg-type]
            continue
        ids = rec.token_ids if flag else (504, 11, 12)
        lps = rec.logprobs if flag and v.cell.name in bitwise else None
        run = CellRun(v.cell.name, {target.request_id: ReplayedOutput(token_ids=ids, text="t", logprobs=lps)})
        out.append(judge(v, run, target, env, Thresholds()))  # type: ignore[arg-type]
    return out


def test_conclusion_names_batch_when_only_the_batch_reproduces() -> None:
    hits, text = conclude(_outcomes(alone=False, batch=True, dtype=False, lane_transformers=False))  # type: ignore[arg-type]
    assert hits == ("batch",)
    assert "dimension(s) batch" in text
    assert "alone diverges at token 1" in text


def test_conclusion_when_alone_reproduces() -> None:
    hits, text = conclude(_outcomes(alone=True, batch=True, dtype=False, lane_transformers=False))  # type: ignore[arg-type]
    assert hits == ("alone", "batch")
    assert text.startswith("the fixed schedule reproduces the recorded tokens")
    assert "bitwise" not in text


def test_conclusion_names_the_variation_that_reproduces_the_logprobs_bitwise() -> None:
    outcomes = _outcomes(("batch",), alone=True, batch=True, dtype=False, lane_transformers=False)
    hits, text = conclude(outcomes)  # type: ignore[arg-type]
    assert hits == ("alone", "batch")
    assert "reproduced bitwise only by batch" in text


def test_conclusion_when_nothing_reproduces_says_so() -> None:
    hits, text = conclude(_outcomes(alone=False, batch=False, dtype=False, lane_transformers=False))  # type: ignore[arg-type]
    assert hits == ()
    assert text.startswith("no variation reproduced the recorded output")
    hits, text = conclude(_outcomes())  # type: ignore[arg-type]
    assert hits == ()
    assert "nothing was reproduced" in text


@pytest.mark.parametrize(("hits", "code"), [((), 1), (("batch",), 0)])
def test_exit_code_and_rendering(hits: tuple[str, ...], code: int) -> None:
    outcomes = _outcomes(alone=False, batch=bool(hits), dtype=False, lane_transformers=False)
    ex = Explanation(
        request_id="r",
        envelope_id="e" * 64,
        recorded_dtype="bfloat16",
        recorded_prefix_caching=True,
        in_flight_at_start=3,
        in_flight_at_end=1,
        batch_size=3,
        companions=("c1",),
        padded_with_workload=1,
        notes=("padded",),
        variations=tuple(outcomes),  # type: ignore[arg-type]
        reproducing=hits,
        conclusion="because",
    )
    assert ex.exit_code == code
    text = render_explanation(ex)
    assert "alone" in text
    assert ("REPRODUCES" in text) == bool(hits)
    assert "engine.version" in text
    assert "skipped" in text
    assert "conclusion: because" in text


def test_the_schedule_variation_reports_its_replays_event_as_judge_reports_a_comparison() -> None:
    env = make_envelope(0)
    result = replay_result(env.envelope_id(), env.request_id)
    event = result.event.model_copy(update={"schedule_reproduced": True, "max_abs_logprob_diff": 0.0})
    ran = schedule_outcome(result.model_copy(update={"event": event}))
    assert (ran.status, ran.reproduced, ran.verdict, ran.first_divergence) == ("ran", True, "bitwise", None)
    assert (ran.recorded_length, ran.replayed_length, ran.max_abs_logprob_diff) == (3, 3, 0.0)
    assert (ran.before_fork, ran.at_fork, ran.replayed_text) == (None, None, "abc")
    # bitwise tokens alone are not the schedule variation reproducing: its schedule must have been reproduced too
    assert schedule_outcome(result).reproduced is False
    skipped = schedule_outcome("no schedule recorded")
    assert (skipped.status, skipped.reason, skipped.verdict) == ("skipped", "no schedule recorded", None)
