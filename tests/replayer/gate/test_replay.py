"""`replayer.gate.replay` and `replayer.gate.golden` with fake lanes: when the gate replays, how it judges, what it
reports."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from replayer.errors import GateInputError, NotReplayableError
from replayer.gate.golden import (
    GoldenSet,
    S3Selector,
    golden_environment,
    load_golden_file,
    load_golden_s3,
    parse_s3_selector,
    record_envelope,
    write_golden,
)
from replayer.gate.replay import render_gate, run_gate
from replayer.lanes.base import GenRequest, Lane
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import (
    CapturedError,
    CapturedOutput,
    Envelope,
    EnvironmentFingerprint,
    ReplayedOutput,
    RuntimeFingerprint,
    SamplingContract,
    StepLogprobs,
    Timings,
)
from tests import factories
from tests.replayer.support import FakeLane, make_envelope, moto_s3, seed_envelope

T0 = datetime(2026, 11, 29, tzinfo=UTC)


def _golden(n: int = 3, **overrides: object) -> tuple[GoldenSet, FakeLane]:
    lane = FakeLane()
    envs = [make_envelope(i, prefix="gate", **overrides) for i in range(n)]  # type: ignore[arg-type]
    for env in envs:
        lane.learn(env)
    return GoldenSet("test", tuple(envs)), lane


def _candidate(base: EnvironmentFingerprint, **runtime: object) -> EnvironmentFingerprint:
    return base.model_copy(update={"runtime": base.runtime.model_copy(update=runtime), "source": "candidate"})


@dataclass
class Opener:
    lane: Lane
    opened: int = 0

    def __call__(self) -> Lane:
        self.opened += 1
        return self.lane


def test_no_fingerprint_change_passes_without_replay() -> None:
    golden, lane = _golden()
    base = golden_environment(golden)
    opener = Opener(lane)
    report = run_gate(golden, base, _candidate(base), opener, ReplayerSettings())
    assert report.gate_passed
    assert not report.replayed
    assert report.changed_fields == ()
    assert report.reason == "no fingerprint change: gate passes without replay"
    assert opener.opened == 0
    assert lane.calls == []
    assert "without replay" in render_gate(report)


def test_changed_dtype_replays_and_fails_when_the_lane_perturbs_tokens() -> None:
    golden, lane = _golden()
    lane.perturb[tuple(golden.envelopes[1].prompt.token_ids)] = 1  # type: ignore[union-attr]
    base = golden_environment(golden)
    report = run_gate(golden, base, _candidate(base, dtype="float32"), Opener(lane), ReplayerSettings())
    assert report.replayed
    assert [d.field for d in report.changed_fields] == ["runtime.dtype"]
    assert report.changed_fields[0].recorded == "bfloat16"
    assert report.changed_fields[0].replayed == "float32"
    assert (report.total, report.passed, report.failed) == (3, 2, 1)
    assert not report.gate_passed
    assert len(lane.calls) == 3
    assert lane.closed
    bad = next(r for r in report.results if not r.target_met)
    assert bad.request_id == golden.envelopes[1].request_id
    assert bad.first_divergence == 1
    assert bad.verdict != "token"
    text = render_gate(report)
    assert "FAIL" in text
    assert "runtime.dtype" in text
    assert f"{bad.request_id}: {bad.verdict}, level token NOT MET, first divergence at token 1" in text


def test_changed_dtype_passes_when_the_lane_echoes() -> None:
    golden, lane = _golden()
    base = golden_environment(golden)
    report = run_gate(golden, base, _candidate(base, dtype="float32"), Opener(lane), ReplayerSettings())
    assert report.replayed
    assert report.gate_passed
    assert report.pass_rate == 1.0
    assert all(r.verdict == "bitwise" and r.target_met for r in report.results)


def test_min_pass_rate_lets_a_partial_failure_through() -> None:
    golden, lane = _golden(2)
    lane.perturb[tuple(golden.envelopes[0].prompt.token_ids)] = 0  # type: ignore[union-attr]
    base = golden_environment(golden)
    cand = _candidate(base, engine_version="0.33.0")
    assert not run_gate(golden, base, cand, Opener(lane), ReplayerSettings()).gate_passed
    half = run_gate(golden, base, cand, Opener(lane), ReplayerSettings(), min_pass_rate=0.5)
    assert half.gate_passed
    assert half.pass_rate == 0.5


def test_always_replay_replays_an_unchanged_environment() -> None:
    golden, lane = _golden(1)
    base = golden_environment(golden)
    report = run_gate(golden, base, base, Opener(lane), ReplayerSettings(), always_replay=True)
    assert report.replayed
    assert report.changed_fields == ()
    assert len(lane.calls) == 1
    assert "--always-replay" in report.reason


def test_unknown_candidate_value_counts_as_a_change() -> None:
    golden, lane = _golden(1)
    base = golden_environment(golden)
    report = run_gate(golden, base, _candidate(base, attention_backend=None), Opener(lane), ReplayerSettings())
    assert [d.field for d in report.changed_fields] == ["runtime.attention_backend"]
    assert report.replayed


@dataclass
class DriftLane:
    """Same token ids as recorded, every chosen logprob shifted by `delta` (bitwise fails, token holds)."""

    inner: FakeLane
    delta: float
    name: str = "drift"
    closed: bool = False
    calls: list[tuple[int, ...]] = field(default_factory=list)

    def fingerprint(self) -> RuntimeFingerprint:
        return self.inner.fp

    def replay(self, request: GenRequest) -> ReplayedOutput:
        out = self.inner.replay(request)
        steps = tuple(
            StepLogprobs(
                token_id=s.token_id,
                token=s.token,
                logprob=s.logprob + self.delta,
                top=tuple(c.model_copy(update={"logprob": c.logprob + self.delta}) for c in s.top),
            )
            for s in out.logprobs or ()
        )
        return out.model_copy(update={"logprobs": steps})

    def close(self) -> None:
        self.closed = True


def test_level_override_judges_every_envelope_at_that_level() -> None:
    golden, fake = _golden(2, target_level="bitwise")
    lane = DriftLane(fake, delta=-1e-3)
    base = golden_environment(golden)
    cand = _candidate(base, dtype="float32")
    declared = run_gate(golden, base, cand, Opener(lane), ReplayerSettings())
    assert not declared.gate_passed
    assert {r.level for r in declared.results} == {"bitwise"}
    assert {r.verdict for r in declared.results} == {"token"}
    relaxed = run_gate(golden, base, cand, Opener(lane), ReplayerSettings(), level="token")
    assert relaxed.gate_passed
    assert relaxed.level_override == "token"
    assert {r.level for r in relaxed.results} == {"token"}


def test_not_replayable_on_the_lane_is_a_failure_with_the_reason() -> None:
    golden, lane = _golden(1)

    def refuse(env: Envelope, lane: Lane, settings: ReplayerSettings) -> object:
        raise NotReplayableError("the transformers lane cannot apply: logit_bias")

    base = golden_environment(golden)
    report = run_gate(
        golden,
        base,
        _candidate(base, dtype="float32"),
        Opener(lane),
        ReplayerSettings(),
        replay_fn=refuse,  # type: ignore[arg-type]
    )
    assert not report.gate_passed
    assert report.not_replayable == 1
    assert report.results[0].verdict == "not_replayable"
    assert "logit_bias" in render_gate(report)


def test_report_round_trips_as_json() -> None:
    golden, lane = _golden(2)
    base = golden_environment(golden)
    report = run_gate(golden, base, _candidate(base, dtype="float32"), Opener(lane), ReplayerSettings())
    data = json.loads(report.model_dump_json())
    assert data["schema_version"] == "reprolane.gate/1"
    assert data["baseline_sha256"] == base.sha256()
    assert data["candidate_sha256"] != data["baseline_sha256"]
    assert data["changed_fields"] == [{"field": "runtime.dtype", "recorded": "bfloat16", "replayed": "float32"}]
    assert {"request_id", "target_met", "level", "first_divergence", "verdict"} <= data["results"][0].keys()
    assert (data["total"], data["passed"], data["gate_passed"]) == (2, 2, True)


# -- golden sets -----------------------------------------------------------------------------------------------


def _error_envelope() -> Envelope:
    return factories.envelope(
        request_id="req-error-1",
        outcome=CapturedError(
            error_type="timeout", message="upstream timed out", timings=Timings(received_at=T0, upstream_ms=1.0)
        ),
    )


def test_golden_file_round_trip_excludes_unreplayable_and_collapses_duplicates(tmp_path: Path) -> None:
    envs = [make_envelope(i, prefix="file") for i in range(2)]
    path = tmp_path / "golden.jsonl"
    write_golden(path, [*envs, envs[0], _error_envelope()])
    golden = load_golden_file(path)
    assert golden.envelopes == tuple(envs)
    assert golden.excluded == (("req-error-1", "the request ended in an error (timeout), not a complete output"),)


def test_golden_file_bad_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "golden.jsonl"
    path.write_text("# comment\n" + make_envelope(1).canonical().decode() + '\n{"request_id": "x"}\n')
    with pytest.raises(GateInputError, match=r"line 3"):
        load_golden_file(path)
    with pytest.raises(GateInputError, match="cannot read"):
        load_golden_file(tmp_path / "missing.jsonl")
    only_errors = tmp_path / "errors.jsonl"
    write_golden(only_errors, [_error_envelope()])
    with pytest.raises(GateInputError, match="no replayable envelope"):
        load_golden_file(only_errors)


def test_golden_environment_refuses_a_mixed_set() -> None:
    a = make_envelope(1)
    b = make_envelope(2, runtime=factories.runtime(dtype="float16"))
    env = golden_environment(GoldenSet("x", (a,)))
    assert env.runtime == a.runtime
    assert env.artifacts == a.artifacts
    with pytest.raises(GateInputError, match="mixes 2 recorded environments"):
        golden_environment(GoldenSet("x", (a, b)))


def test_parse_s3_selector() -> None:
    assert parse_s3_selector("s3:tenant=acme") == S3Selector("tenant", ("acme",))
    assert parse_s3_selector("s3:request-ids=a, b") == S3Selector("request-ids", ("a", "b"))
    assert str(parse_s3_selector("s3:workflow=wf-1")) == "s3:workflow=wf-1"
    for bad in ("tenant=acme", "s3:tenant", "s3:colour=red", "s3:tenant=", "s3:tenant=a,b"):
        with pytest.raises(GateInputError, match="golden selector"):
            parse_s3_selector(bad)


def test_golden_from_s3_selectors() -> None:
    with moto_s3() as s3:
        client = s3.client()
        acme = [make_envelope(i, prefix="s3g", tenant="acme", workflow="wf-9") for i in range(3)]
        other = make_envelope(7, prefix="s3g", tenant="other")
        for env in [*acme, other, _error_envelope().model_copy(update={"tenant": "acme"})]:
            seed_envelope(client, s3.bucket, env)
        store = EnvelopeStore(client, s3.bucket)
        by_tenant = load_golden_s3(store, parse_s3_selector("s3:tenant=acme"))
        assert sorted(e.request_id for e in by_tenant.envelopes) == sorted(e.request_id for e in acme)
        assert [rid for rid, _ in by_tenant.excluded] == ["req-error-1"]
        assert len(load_golden_s3(store, parse_s3_selector("s3:tenant=acme"), limit=2).envelopes) <= 2
        by_wf = load_golden_s3(store, parse_s3_selector("s3:workflow=wf-9"))
        assert [e.request_id for e in by_wf.envelopes] == [e.request_id for e in acme]
        ids = f"s3:request-ids={other.request_id},{acme[0].request_id}"
        assert [e.request_id for e in load_golden_s3(store, parse_s3_selector(ids)).envelopes] == [
            other.request_id,
            acme[0].request_id,
        ]
        with pytest.raises(GateInputError, match="nobody"):
            load_golden_s3(store, parse_s3_selector("s3:tenant=nobody"))


def test_record_envelope_is_a_replayable_golden_envelope() -> None:
    out = ReplayedOutput(token_ids=(5, 6), text="hi", logprobs=None, finish_reason="length")
    sampling = SamplingContract(temperature=0.0, max_tokens=2, seed_scope="none")
    env = record_envelope(
        request_id="g-1", prompt_token_ids=(1, 2, 3), prompt_text=None, sampling=sampling, output=out,
        runtime=factories.runtime(), artifacts=factories.envelope().artifacts, model="m", target_level="bitwise",
        captured_at=T0,
    )  # fmt: skip
    assert env.replayable
    assert env.target_level == "bitwise"
    assert isinstance(env.outcome, CapturedOutput)
    assert env.outcome.choices[0].token_ids == (5, 6)
    assert env.prompt is not None
    assert env.prompt.source == "lane"
