"""The shadow report (`replayer.gate.shadow`): pairs read from S3 (moto) and judged per request and as
distributions; the stated rule names what failed; ``release gate --shadow`` exits as the gate (0, 1, 2)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.cli.root import build_app
from infra.release.gate_cli import build_gate_app, parse_when
from replayer.errors import GateInputError
from replayer.gate.shadow import ShadowBars, load_pairs, shadow_gate
from replayer.store import EnvelopeStore
from schemas import CapturedError, CapturedOutput, Choice, Envelope, ShadowMarker
from tests.infra.release.known_good_support import MemoryHistory
from tests.replayer.support import S3Target, make_envelope, moto_s3, seed_envelope, seed_shadow

NOW = datetime.now(UTC).replace(microsecond=0)
CAND = "http://127.0.0.1:9/candidate"


def shadow_of(prod: Envelope, *, ids: tuple[int, ...] | None = None, text: str | None = None,
              finish: str = "stop", error: bool = False) -> Envelope:  # fmt: skip
    assert isinstance(prod.outcome, CapturedOutput)
    choice = prod.outcome.choices[0]
    new_choice = Choice(index=0, token_ids=ids if ids is not None else choice.token_ids,
                        text=text if text is not None else choice.text, finish_reason=finish)  # fmt: skip
    outcome: Any = (
        CapturedError(error_type="timeout", message="candidate timed out", timings=prod.outcome.timings)
        if error
        else prod.outcome.model_copy(update={"choices": (new_choice,)})
    )
    return prod.model_copy(
        update={
            "captured_at": prod.captured_at + timedelta(seconds=1),
            "runtime": prod.runtime.model_copy(update={"dtype": "float32"}),
            "outcome": outcome,
            "flagged": False,
            "shadow": ShadowMarker(production_envelope_id=prod.envelope_id(), candidate=CAND),
        }
    )


def production(n: int, *, now: datetime = NOW) -> Envelope:
    """Production envelope ``n``, captured five minutes before ``now`` (the module's import time by default: the
    windows the tests give `load_pairs` and `shadow_gate` end there)."""
    return make_envelope(n, prefix="shadow", captured_at=now - timedelta(minutes=5), workflow=None)


def sim(a: str, b: str) -> float:
    return 1.0 if a == b else 0.5


def gate(pairs: list[tuple[Envelope, Envelope]], **kw: Any) -> Any:
    return shadow_gate(pairs, [], since=NOW - timedelta(hours=1), until=NOW, similarity=sim, **kw)


def test_identical_candidate_passes_with_every_rule_stated() -> None:
    pairs = [(p, shadow_of(p)) for p in map(production, range(4))]
    report = gate(pairs)
    assert report.gate_passed, report.failures
    assert (report.pairs, report.passed, report.token_identical, report.candidate_errors) == (4, 4, 4, 0)
    assert "candidate errors == 0" in report.rule
    assert [d.field for d in report.changed_fields] == ["dtype"]
    assert report.similarity.p10 == 1.0


def test_a_differing_candidate_fails_with_the_differences_named() -> None:
    prods = [production(i) for i in range(4)]
    pairs = [(p, shadow_of(p)) for p in prods[:2]]
    pairs.append((prods[2], shadow_of(prods[2], ids=(504, 1, 2), text="Paris is far.", finish="length")))
    pairs.append((prods[3], shadow_of(prods[3], error=True)))
    report = gate(pairs)
    assert not report.gate_passed
    text = "\n".join(report.failures)
    assert "candidate errors: 1 of 4" in text
    assert "per request: 2/4 met their level" in text
    assert "finish reasons" in text
    diverged = next(r for r in report.results if r.request_id == prods[2].request_id)
    assert (diverged.verdict, diverged.first_divergence, diverged.target_met) == ("diverged", 1, False)
    # at a semantic level with a low similarity bar the same token divergence is accepted
    lenient = gate(pairs[:3], level="semantic", bars=ShadowBars(min_similarity=0.4, max_finish_shift=0.5))
    assert lenient.gate_passed, lenient.failures


def test_no_pair_is_no_verdict() -> None:
    with pytest.raises(GateInputError, match="no shadow pair"):
        gate([])


@pytest.fixture
def s3() -> Iterator[S3Target]:
    with moto_s3() as target:
        yield target


def test_pairs_are_read_from_the_bucket_within_the_window(s3: S3Target) -> None:
    prods = [production(i) for i in range(3)]
    for p in prods:
        seed_envelope(s3.client(), s3.bucket, p)
    for p in prods[:2]:
        seed_shadow(s3.client(), s3.bucket, shadow_of(p))
    orphan = production(9)  # a shadow whose production envelope never arrived
    seed_shadow(s3.client(), s3.bucket, shadow_of(orphan))
    store = EnvelopeStore(s3.client(), s3.bucket)
    pairs, unpaired = load_pairs(store, NOW - timedelta(hours=1), NOW)
    assert sorted(p.request_id for p, _ in pairs) == sorted(p.request_id for p in prods[:2])
    assert [rid for rid, _ in unpaired] == [orphan.request_id]
    assert load_pairs(store, NOW - timedelta(minutes=1), NOW) == ([], [])  # the window excludes them


def test_gate_shadow_through_the_cli(s3: S3Target, tmp_path: Path) -> None:
    # the CLI's --since is relative to the clock when it runs, not to the module's import (the suite takes an hour)
    prods = [production(i, now=datetime.now(UTC)) for i in range(3)]
    for p in prods:
        seed_envelope(s3.client(), s3.bucket, p)
    seed_shadow(s3.client(), s3.bucket, shadow_of(prods[0]))
    seed_shadow(s3.client(), s3.bucket, shadow_of(prods[1], ids=(504, 7, 2), text="Lyon."))
    app = build_app({"gate": build_gate_app(store_factory=lambda s: EnvelopeStore(s3.client(), s3.bucket),
                                            similarity=sim, history_factory=lambda s: MemoryHistory())})  # fmt: skip
    report = tmp_path / "shadow.json"
    failed = CliRunner().invoke(app, ["release", "gate", "--shadow", "--since", "1h", "--report", str(report)])
    assert failed.exit_code == 1, failed.output
    assert "Shadow gate: FAIL — 2 pair(s)" in failed.stdout
    assert "per request: 1/2 met their level" in failed.stdout
    assert (
        "runtime differs from production in: dtype 'bfloat16' → 'float32'" in failed.stdout or "dtype" in failed.stdout
    )
    written = json.loads(report.read_text())
    assert written["mode"] == "shadow"
    bars = ("min_pass_rate", "min_similarity", "max_length_change", "max_finish_shift")
    assert {k: written[k] for k in bars} == ShadowBars().model_dump()  # the report repeats the bars it applied
    passed = CliRunner().invoke(
        app, ["release", "gate", "--shadow", "--since", "1h", "--level", "semantic", "--min-similarity", "0.4"]
    )
    assert passed.exit_code == 0, passed.output
    empty = CliRunner().invoke(app, ["release", "gate", "--shadow", "--since", "1m"])
    assert empty.exit_code == 2
    assert "no shadow pair" in empty.stderr
    bad = CliRunner().invoke(app, ["release", "gate", "--shadow", "--since", "yesterday"])
    assert bad.exit_code == 2
    assert "--since" in bad.stderr


def test_window_times_parse_as_iso_or_age() -> None:
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)
    assert parse_when("30m", "--since", now) == now - timedelta(minutes=30)
    assert parse_when("2026-12-01T10:00:00Z", "--since", now) == datetime(2026, 12, 1, 10, tzinfo=UTC)
    assert parse_when("2026-12-01T10:00:00", "--since", now).tzinfo is not None
