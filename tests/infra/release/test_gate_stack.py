"""The release gate on real lanes: a 3-request golden set recorded on the in-process vLLM lane (greedy, 12 tokens),
gated against the same lane (unchanged fingerprint: passes without replay) and against the float32 transformers
lane (engine and dtype change: every envelope is replayed and judged at token level); then the statistical gate
samples the stack's vLLM server without a seed and judges with the real all-MiniLM-L6-v2 similarity.

One engine per lane for the module; the CLI gets them through its lane factory (closing is a no-op here).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.cli.root import app as root_app
from infra.cli.root import build_app
from infra.release.gate_cli import build_gate_app
from infra.stack.state import StackInfo
from replayer.gate.golden import load_golden_file
from replayer.lanes import GenRequest, Lane, make_lane
from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint

pytestmark = pytest.mark.stack

PROMPTS = [
    "Name three primary colors and explain why.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
]


class Kept:
    """A started lane shared by several CLI invocations: `close` is left to the fixture."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.name = lane.name

    def fingerprint(self) -> RuntimeFingerprint:
        return self.lane.fingerprint()

    def replay(self, request: GenRequest) -> ReplayedOutput:
        return self.lane.replay(request)

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def lanes(stack: StackInfo) -> Iterator[dict[str, Kept]]:
    started: dict[str, Kept] = {}
    try:
        for name in ("vllm", "transformers"):
            started[name] = Kept(make_lane(ReplayerSettings(lane=name, model_dir=stack.model_dir)))  # type: ignore[arg-type]
        yield started
    finally:
        for kept in started.values():
            kept.lane.close()


def _invoke(lanes: dict[str, Kept], *args: str) -> Any:
    app = build_app({"gate": build_gate_app(lane_factory=lambda s: lanes[s.lane])})
    return CliRunner().invoke(app, ["release", "gate", *args])


@pytest.fixture(scope="module")
def golden(stack: StackInfo, lanes: dict[str, Kept], tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("gate")
    workload = tmp / "workload.jsonl"
    workload.write_text(
        "".join(
            json.dumps({"request_id": f"gate-{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
            for i, p in enumerate(PROMPTS)
        )
    )
    out = tmp / "golden.jsonl"
    assert stack.vllm_url is not None
    result = _invoke(
        lanes, "record-golden", "--output", str(out), "--workload-file", str(workload), "--lane", "vllm",
        "--model-dir", str(stack.model_dir), "--tokenize-url", stack.vllm_url, "--max-tokens", "12",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


def test_golden_set_recorded_on_the_vllm_lane(golden: Path) -> None:
    envs = load_golden_file(golden).envelopes
    assert [e.request_id for e in envs] == ["gate-0", "gate-1", "gate-2"]
    for env in envs:
        assert env.runtime.engine == "vllm"
        assert env.runtime.dtype == "bfloat16"
        assert env.artifacts.model_sha256 is not None
        assert env.outcome.kind == "output"
        choice = env.outcome.choices[0]
        assert 1 <= len(choice.token_ids) <= 12
        assert choice.finish_reason in ("stop", "length")
        assert choice.logprobs is not None


def test_same_lane_unchanged_fingerprint_passes_without_replay(
    golden: Path, lanes: dict[str, Kept], stack: StackInfo, tmp_path: Path
) -> None:
    report = tmp_path / "same.json"
    result = _invoke(
        lanes, "--baseline", "golden", "--candidate", "local", "--lane", "vllm", "--model-dir", str(stack.model_dir),
        "--golden", str(golden), "--report", str(report),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["changed_fields"] == []
    assert data["replayed"] is False
    assert data["baseline_sha256"] == data["candidate_sha256"]


def test_transformers_candidate_changes_engine_and_dtype_and_replays(
    golden: Path, lanes: dict[str, Kept], stack: StackInfo, tmp_path: Path
) -> None:
    report = tmp_path / "transformers.json"
    result = _invoke(
        lanes, "--baseline", "golden", "--candidate", "local", "--lane", "transformers",
        "--model-dir", str(stack.model_dir), "--golden", str(golden), "--report", str(report),
    )  # fmt: skip
    data = json.loads(report.read_text())
    fields = [d["field"] for d in data["changed_fields"]]
    assert "runtime.engine" in fields
    assert "runtime.dtype" in fields
    assert "artifacts.model_sha256" not in fields  # same model folder, same verified artifacts
    assert data["replayed"] is True
    assert data["total"] == 3
    assert "runtime.dtype" in result.stdout
    verdicts = [(r["request_id"], r["verdict"], r["first_divergence"], r["near_tie"]) for r in data["results"]]
    # What the candidate lane gives for each golden envelope, replayed here outside the gate (the lane is
    # deterministic run to run): which of them fork between bf16 vLLM and fp32 transformers depends on the CPU's
    # kernels (a near tie at token 0 of gate-1 on an AMX host, at token 5 of gate-2 on an AVX2 one), so the
    # expectation is computed on this host rather than written down from another.
    settings = ReplayerSettings(lane="transformers", model_dir=stack.model_dir)  # type: ignore[arg-type]
    expected, missed = [], []
    for env in load_golden_file(golden).envelopes:
        event = replay_envelope(env, lanes["transformers"], settings).event
        first = event.first_divergence
        expected.append(
            (
                env.request_id,
                event.verdict,
                None if first is None else first.position,
                None if first is None else first.near_tie,
            )
        )
        if not event.target_met:
            missed.append((env.request_id, event.verdict, None if first is None else first.position))
    assert verdicts == expected
    assert (data["passed"], data["failed"]) == (3 - len(missed), len(missed))
    assert data["gate_passed"] is (not missed)
    assert result.exit_code == (1 if missed else 0), result.output
    for request_id, verdict, position in missed:  # the report says where each one forked
        assert f"{request_id}: {verdict}, level token NOT MET" in result.stdout
        if position is not None:
            assert f"first divergence at token {position}" in result.stdout


def test_statistical_gate_on_the_stack_server_with_real_similarity(
    golden: Path, stack: StackInfo, tmp_path: Path
) -> None:
    """The golden envelopes as cases for the stack's server (recorded sampling: greedy; no seed is sent), judged by
    the real all-MiniLM-L6-v2 similarity; then the same cases with unrelated recorded texts must fail."""
    assert stack.vllm_url is not None
    checks = tmp_path / "assert.json"
    # gate-1's recorded answer starts with what the stack's server (the same engine and dtype) answers too; which
    # words those are depends on the CPU (a near tie at its first token), so the assertion is taken from it.
    recorded = {e.request_id: e for e in load_golden_file(golden).envelopes}["gate-1"]
    first_word = recorded.outcome.choices[0].text.split()[0]  # type: ignore[union-attr]
    checks.write_text(json.dumps({"gate-1": [{"contains": first_word}, {"max_length": 200}]}))

    def run(cases: Path, report: Path) -> tuple[int, dict[str, Any]]:
        result = CliRunner().invoke(
            root_app,
            ["release", "gate", "--statistical", "--golden", str(cases), "--upstream", str(stack.vllm_url),
             "--samples", "2", "--assertions", str(checks), "--min-similarity", "0.7", "--report", str(report)],
        )  # fmt: skip
        assert result.exit_code in (0, 1), result.output
        return result.exit_code, json.loads(report.read_text())

    code, data = run(golden, tmp_path / "same.json")
    assert code == 0, data
    assert data["total"] == 3
    for case in data["cases"]:
        assert len(case["similarities"]) == 2
        assert case["mean_similarity"] >= 0.7
        assert case["observed_versions"]["system_fingerprint"][0].startswith("vllm-0.32.0-")
    assert data["cases"][1]["assertion_passes"] == 4

    unrelated = tmp_path / "unrelated.jsonl"
    lines = []
    for line in golden.read_text().splitlines():
        env = json.loads(line)
        env["outcome"]["choices"][0]["text"] = "Bananas are a yellow fruit rich in potassium."
        lines.append(json.dumps(env))
    unrelated.write_text("\n".join(lines) + "\n")
    code, data = run(unrelated, tmp_path / "unrelated.json")
    assert code == 1
    assert all(c["mean_similarity"] < 0.4 for c in data["cases"]), [c["mean_similarity"] for c in data["cases"]]
    assert data["passed"] == 0
