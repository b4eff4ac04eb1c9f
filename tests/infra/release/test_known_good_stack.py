"""Known-good environments through the CLI on the stack's audit bucket (SeaweedFS, Object Lock): a passing gate
writes its candidate's environment with the model folder's manifest, ``fingerprint history --json`` lists it as one
JSON document, and a failing gate names it as the rollback target. The lane is the fake one (what is under test
is the record and its bucket, not a replay); the model folder is the stack's real one."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.cli.root import app as root_app
from infra.cli.root import build_app
from infra.model.manifest import load_manifest
from infra.release.gate_cli import build_gate_app
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo
from replayer.gate.golden import GoldenSet, golden_environment, write_golden
from replayer.settings import ReplayerSettings
from tests.replayer.support import FakeLane, make_envelope

pytestmark = pytest.mark.stack


def test_pass_is_recorded_listed_and_named_by_a_later_failure(
    stack: StackInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in stack_defaults(stack).items():
        monkeypatch.setenv(key, value)
    assert stack.model_dir is not None
    deployment = f"stack-{uuid.uuid4().hex[:10]}"
    lane = FakeLane()
    envelopes = [make_envelope(i, prefix="kg") for i in range(2)]
    for env in envelopes:
        lane.learn(env)
    golden = tmp_path / "golden.jsonl"
    write_golden(golden, envelopes)

    def invoke(*args: str) -> Any:
        gate = build_gate_app(lane_factory=lambda s: lane)
        return CliRunner().invoke(build_app({"gate": gate}), ["release", "gate", *args])

    common = ("--golden", str(golden), "--baseline", "golden", "--deployment", deployment)
    passed = invoke(
        *common, "--candidate", "local", "--lane", "remote", "--model-dir", str(stack.model_dir),
        "--image", "localhost:5000/reprolane/vllm-cpu:0.32.0", "--engine-args", "--dtype bfloat16 --enforce-eager",
    )  # fmt: skip
    assert passed.exit_code == 0, passed.output
    assert "Recorded known-good environment" in passed.stdout

    listed = CliRunner().invoke(root_app, ["release", "fingerprint", "history", "--deployment", deployment, "--json"])
    assert listed.exit_code == 0, listed.output
    doc = json.loads(listed.stdout)  # exactly one JSON document
    [rec] = doc["records"]
    manifest = load_manifest(stack.model_dir)
    assert rec["manifest"]["model_sha256"] == manifest.model_sha256
    assert rec["manifest"]["files"] == manifest.files
    assert rec["image"]["tag"] == "0.32.0"
    assert rec["engine_args"] == ["--dtype", "bfloat16", "--enforce-eager"]
    assert rec["environment"]["artifacts"]["model_sha256"] == manifest.model_sha256
    assert doc["rejected"] == []
    text = CliRunner().invoke(root_app, ["release", "fingerprint", "history", "--deployment", deployment])
    assert rec["environment_sha256"][:16] in text.stdout

    # a candidate that changes the runtime and diverges: the gate fails and names the recorded environment
    base = golden_environment(GoldenSet("x", tuple(envelopes)))
    cand = tmp_path / "cand.json"
    cand.write_text(
        base.model_copy(update={"runtime": base.runtime.model_copy(update={"dtype": "float32"})}).model_dump_json()
    )
    lane.perturb[tuple(envelopes[1].prompt.token_ids)] = 0  # type: ignore[union-attr]
    report = tmp_path / "fail.json"
    failed = invoke(*common, "--candidate", str(cand), "--report", str(report))
    assert failed.exit_code == 1, failed.output
    assert f"Last known-good environment ({deployment}): {rec['environment_sha256']}" in failed.stdout
    assert "localhost:5000/reprolane/vllm-cpu:0.32.0" in failed.stdout
    assert manifest.model_sha256 in failed.stdout
    assert json.loads(report.read_text())["rollback"]["environment_sha256"] == rec["environment_sha256"]
    assert ReplayerSettings().s3_bucket == stack.audit_bucket
