"""Known-good records for the tests of `infra.release.known_good` and the gate: a passing report, its record, and an
in-memory history (the gate's unit tests; the S3 store is tested on moto and the stack)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from infra.release.known_good import History
from replayer.gate.golden import GoldenSet, golden_environment
from replayer.gate.replay import GateReport
from schemas import EnvironmentFingerprint
from schemas.known_good import KnownGoodEnvironment, parse_image_ref
from tests.replayer.support import make_envelope

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def environment(**runtime: object) -> EnvironmentFingerprint:
    base = golden_environment(GoldenSet("x", (make_envelope(0, prefix="kg"),)))
    return base.model_copy(update={"runtime": base.runtime.model_copy(update=runtime)})


def passing_report(candidate: EnvironmentFingerprint, *, at: datetime = T0) -> GateReport:
    base = environment()
    return GateReport(
        golden="golden.jsonl", baseline=base, candidate=candidate, baseline_sha256=base.sha256(),
        candidate_sha256=candidate.sha256(), changed_fields=(), replayed=True, reason="replayed 3", lane="fake",
        min_pass_rate=1.0, total=3, passed=3, failed=0, not_replayable=0, pass_rate=1.0, gate_passed=True,
        started_at=at, finished_at=at,
    )  # fmt: skip


def record(deployment: str, *, minutes: int = 0, **runtime: object) -> KnownGoodEnvironment:
    from infra.release.known_good import build_known_good

    env = environment(**runtime)
    return build_known_good(
        passing_report(env, at=T0 + timedelta(minutes=minutes)),
        deployment=deployment,
        image=parse_image_ref("ghcr.io/acme/vllm:0.32.0@sha256:" + "ab" * 32),
        engine_args=("--dtype", "bfloat16", "--max-num-seqs", "8"),
        manifest=None,
    )


class MemoryHistory:
    """`infra.release.known_good.KnownGoodHistory` in a dict (newest first by key, like the store)."""

    def __init__(self) -> None:
        self.records: dict[str, KnownGoodEnvironment] = {}

    def put(self, record: KnownGoodEnvironment) -> str:
        from schemas.layout import known_good_key

        key = known_good_key(record.deployment, record.passed_at, record.record_id())
        self.records.setdefault(key, record)
        return key

    def history(self, deployment: str, *, limit: int | None = None) -> History:
        mine = [r for k, r in sorted(self.records.items(), reverse=True) if r.deployment == deployment]
        return History(tuple(mine[:limit]))
