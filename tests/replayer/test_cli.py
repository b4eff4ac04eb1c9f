"""`reprolane replay request|workflow` through typer's CliRunner and the root's error boundary, with a fake or
perturbing lane injected.

Written once, run twice: against moto (fast) and, marked ``stack``, against the real SeaweedFS of the stack
(its Object-Lock audit bucket).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.cli.root import build_app
from replayer.cli import build_replay_app, build_replayer_app
from replayer.settings import ReplayerSettings
from schemas import CapturedError, PromptRecord, Timings, decode_replay_result
from tests import factories
from tests.replayer.support import BACKENDS, FakeLane, S3Target, make_envelope, s3_backend, seed_envelope


@pytest.fixture(scope="module", params=BACKENDS)
def s3(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    yield from s3_backend(request)


class Cli:
    def __init__(self, s3: S3Target) -> None:
        self.s3 = s3
        self.lane = FakeLane()
        self.settings_seen: list[ReplayerSettings] = []

    def factory(self, settings: ReplayerSettings) -> FakeLane:
        self.settings_seen.append(settings)
        return self.lane

    def invoke(self, *args: str) -> Any:
        app = build_app({"replay": build_replay_app(lane_factory=self.factory)})
        s3_args = [
            "--s3-endpoint", self.s3.endpoint, "--s3-access-key", self.s3.access_key,
            "--s3-secret-key", self.s3.secret_key, "--s3-bucket", self.s3.bucket,
        ]  # fmt: skip
        return CliRunner().invoke(app, ["replay", *args, *s3_args])

    def seed(self, n: int, *, diverge_at: int | None = None, **overrides: Any) -> Any:
        env = make_envelope(n, **overrides)
        if env.replayable:
            self.lane.learn(env, diverge_at=diverge_at)
        seed_envelope(self.s3.client(), self.s3.bucket, env)
        return env


@pytest.fixture
def cli(s3: S3Target) -> Cli:
    return Cli(s3)


def _one_line_error(result: Any) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("reprolane: error: ")
    return str(lines[0])


def test_request_that_replays_bitwise_exits_0(cli: Cli) -> None:
    env = cli.seed(1)
    result = cli.invoke("request", env.request_id, "--lane", "transformers")
    assert result.exit_code == 0, result.output
    assert "Verdict: bitwise" in result.stdout
    assert "target level: token — met" in result.stdout
    assert cli.settings_seen[0].lane == "transformers"
    assert cli.lane.closed


def test_request_that_diverges_exits_1_and_marks_the_fork(cli: Cli) -> None:
    env = cli.seed(2, diverge_at=1)
    result = cli.invoke("request", env.request_id)
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert "Verdict: diverged" in out
    assert "NOT MET" in out
    assert "First divergence: generated token 1, confident flip" in out
    assert "recorded: t504⟦t3575t2⟧" in out
    assert "replayed: t504⟦t28⟧" in out
    assert '"t3575" #3575 -0.2500' in out


def test_request_json_prints_the_replay_result(cli: Cli) -> None:
    env = cli.seed(3)
    result = cli.invoke("request", env.request_id, "--json")
    assert result.exit_code == 0, result.output
    parsed = decode_replay_result(result.stdout)
    assert parsed.event.envelope_id == env.envelope_id()
    assert parsed.event.verdict == "bitwise"


def test_unknown_request_id_exits_2_with_one_line(cli: Cli) -> None:
    line = _one_line_error(cli.invoke("request", f"nobody-{uuid.uuid4().hex[:8]}"))
    assert "no envelope is indexed under request id" in line
    assert cli.settings_seen == []  # no lane was started for an unknown id


def test_bad_lane_exits_2_with_one_line(cli: Cli) -> None:
    line = _one_line_error(cli.invoke("request", "req-1", "--lane", "tpu"))
    assert "--lane must be one of" in line


def test_unreplayable_request_exits_2(cli: Cli) -> None:
    timings = Timings(received_at=factories.FIXED_TIME, upstream_ms=1.0)
    env = cli.seed(
        4, outcome=CapturedError(error_type="upstream_error", status_code=500, message="boom", timings=timings)
    )
    line = _one_line_error(cli.invoke("request", env.request_id))
    assert "not replayable" in line


def test_request_with_several_prompts_replays_the_first_prompts_choice_0_and_says_so(cli: Cli) -> None:
    env = cli.seed(5, more_prompts=(PromptRecord(token_ids=(7, 8), source="upstream"),))
    result = cli.invoke("request", env.request_id, "--json")
    assert result.exit_code == 0, result.output
    parsed = decode_replay_result(result.stdout)
    assert parsed.event.verdict == "bitwise"
    assert "2 prompts: only the first prompt's choice 0 was replayed" in parsed.event.cause_detail


def test_workflow_reports_the_first_diverging_step(cli: Cli) -> None:
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    cli.seed(0, workflow=wf)
    cli.seed(1, workflow=wf)
    diverging = cli.seed(2, workflow=wf, diverge_at=2)
    cli.seed(3, workflow=wf, diverge_at=0)
    result = cli.invoke("workflow", wf)
    assert result.exit_code == 1, result.output
    out = result.stdout
    assert f"Workflow {wf}: 4 recorded step(s)" in out
    assert f"First diverging step: 2 (request {diverging.request_id})" in out
    assert "first divergence at token 2" in out
    assert out.index("step   0") < out.index("step   1") < out.index("step   2") < out.index("step   3")
    as_json = json.loads(cli.invoke("workflow", wf, "--json").stdout)
    assert as_json["first_diverging_step"] == 2
    assert [s["step"] for s in as_json["steps"]] == [0, 1, 2, 3]


def test_workflow_that_holds_exits_0_and_unknown_exits_2(cli: Cli) -> None:
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    cli.seed(0, workflow=wf)
    cli.seed(1, workflow=wf)
    result = cli.invoke("workflow", wf)
    assert result.exit_code == 0, result.output
    assert "Every replayed step met its target level." in result.stdout
    _one_line_error(cli.invoke("workflow", f"wf-{uuid.uuid4().hex[:8]}"))


def test_workflow_steps_of_another_tenant_need_the_tenant_named(cli: Cli) -> None:
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    cli.seed(0, workflow=wf, tenant="acme-bank")
    cli.seed(1, workflow=wf, tenant="acme-bank")
    cli.seed(2, workflow=wf, tenant="attacker", diverge_at=0)
    line = _one_line_error(cli.invoke("workflow", wf))
    assert "has steps of tenants acme-bank, attacker" in line
    result = cli.invoke("workflow", wf, "--tenant", "acme-bank")
    assert result.exit_code == 0, result.output
    assert f"Workflow {wf}: 2 recorded step(s)" in result.stdout


def test_replayer_serve_passes_settings_from_options() -> None:
    seen: list[ReplayerSettings] = []
    app = build_app({"replayer": build_replayer_app(serve_fn=seen.append)})
    args = ["serve", "--kafka-bootstrap", "127.0.0.1:1", "--group-id", "g1", "--replay-all", "--metrics-port", "0"]
    result = CliRunner().invoke(app, ["replayer", *args])
    assert result.exit_code == 0, result.output
    (settings,) = seen
    assert (settings.kafka_bootstrap, settings.group_id, settings.replay_all, settings.metrics_port) == (
        "127.0.0.1:1", "g1", True, 0
    )  # fmt: skip
