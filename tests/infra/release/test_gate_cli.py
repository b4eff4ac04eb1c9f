"""`reprolane release gate` and `gate record-golden` through CliRunner with a fake lane, store, sampler and similarity:
exit codes (0 pass, 1 fail, 2 no verdict with one line), the JSON report, the readable summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.cli.root import app as root_app
from infra.cli.root import build_app
from infra.release.gate_cli import build_gate_app
from replayer.gate.golden import golden_environment, load_golden_file, write_golden
from replayer.gate.statistical import Sample, VendorCase
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from tests.infra.release.known_good_support import MemoryHistory
from tests.replayer.support import LANE_FINGERPRINT, FakeLane, make_envelope, moto_s3, seed_envelope


class Harness:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.lane = FakeLane()
        self.opened = 0
        self.envelopes = [make_envelope(i, prefix="cli") for i in range(3)]
        for env in self.envelopes:
            self.lane.learn(env)
        self.golden = tmp / "golden.jsonl"
        write_golden(self.golden, self.envelopes)
        self.store: EnvelopeStore | None = None
        self.history = MemoryHistory()

    def factory(self, settings: ReplayerSettings) -> FakeLane:
        self.opened += 1
        return self.lane

    def fingerprint(self, name: str, **runtime: Any) -> Path:
        from replayer.gate.golden import GoldenSet

        base = golden_environment(GoldenSet("x", tuple(self.envelopes)))
        fp = base.model_copy(update={"runtime": base.runtime.model_copy(update=runtime)})
        path = self.tmp / name
        path.write_text(fp.model_dump_json())
        return path

    def invoke(self, *args: str) -> Any:
        gate = build_gate_app(
            lane_factory=self.factory,
            store_factory=lambda s: self._store(),
            sampler_factory=lambda url, model: Para(),
            similarity=lambda a, b: 1.0 if "Paris" in b else 0.0,
            history_factory=lambda s: self.history,
        )
        return CliRunner().invoke(build_app({"gate": gate}), ["release", "gate", *args])

    def _store(self) -> EnvelopeStore:
        assert self.store is not None
        return self.store


class Para:
    def sample(self, case: VendorCase) -> Sample:
        return Sample(text="Paris, of course.", versions={"model": "m-2"})


@pytest.fixture
def h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def test_unchanged_fingerprint_passes_without_replay(h: Harness) -> None:
    same = h.fingerprint("same.json")
    result = h.invoke("--baseline", "golden", "--candidate", str(same), "--golden", str(h.golden))
    assert result.exit_code == 0, result.output
    assert "no fingerprint change: gate passes without replay" in result.stdout
    assert h.opened == 0


def test_changed_dtype_with_perturbed_lane_fails_and_writes_the_report(h: Harness) -> None:
    h.lane.perturb[tuple(h.envelopes[2].prompt.token_ids)] = 0  # type: ignore[union-attr]
    cand = h.fingerprint("cand.json", dtype="float32")
    report = h.tmp / "report.json"
    result = h.invoke(
        "--baseline", "golden", "--candidate", str(cand), "--golden", str(h.golden), "--report", str(report)
    )
    assert result.exit_code == 1, result.output
    assert "runtime.dtype" in result.stdout
    assert "first divergence at token 0" in result.stdout
    data = json.loads(report.read_text())
    assert data["gate_passed"] is False
    assert data["replayed"] is True
    assert [d["field"] for d in data["changed_fields"]] == ["runtime.dtype"]
    assert (data["total"], data["passed"], data["failed"]) == (3, 2, 1)
    failed = [r for r in data["results"] if not r["target_met"]]
    assert [(r["request_id"], r["first_divergence"]) for r in failed] == [(h.envelopes[2].request_id, 0)]
    assert h.lane.closed


def test_changed_dtype_with_echoing_lane_passes(h: Harness) -> None:
    base = h.fingerprint("base.json")
    cand = h.fingerprint("cand.json", dtype="float32")
    result = h.invoke("--baseline", str(base), "--candidate", str(cand), "--golden", str(h.golden))
    assert result.exit_code == 0, result.output
    assert "3 met their level, 0 did not" in result.stdout
    assert h.opened == 1


def test_local_candidate_fingerprints_the_lane(h: Harness) -> None:
    # remote lane without --model-dir: artifacts unknown, runtime from the (fake) lane itself
    result = h.invoke("--baseline", "golden", "--candidate", "local", "--lane", "remote", "--golden", str(h.golden))
    assert result.exit_code == 0, result.output
    assert "artifacts.model_sha256" in result.stdout
    assert "runtime.max_num_seqs" in result.stdout  # the fake lane's own fingerprint, not a declared one
    assert h.opened == 1
    assert LANE_FINGERPRINT.max_num_seqs == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--baseline", "golden", "--candidate", "local"), "--golden is required"),
        (("--golden", "GOLDEN", "--candidate", "local"), "--baseline and --candidate are required"),
        (("--golden", "missing.jsonl", "--baseline", "golden", "--candidate", "CAND"), "cannot read golden set"),
        (("--golden", "s3:colour=red", "--baseline", "golden", "--candidate", "CAND"), "golden selector"),
        (("--golden", "GOLDEN", "--baseline", "BAD", "--candidate", "CAND"), "baseline"),
        (("--golden", "GOLDEN", "--baseline", "golden", "--candidate", "CAND", "--level", "exact"), "--level"),
        (("--golden", "GOLDEN", "--statistical"), "--upstream"),
    ],
)
def test_bad_input_exits_2_with_one_line(h: Harness, args: tuple[str, ...], message: str) -> None:
    bad = h.tmp / "bad.json"
    bad.write_text('{"runtime": {}}')
    cand = h.fingerprint("cand.json", dtype="float32")
    subst = {"GOLDEN": str(h.golden), "CAND": str(cand), "BAD": str(bad), "missing.jsonl": str(h.tmp / "no.jsonl")}
    result = h.invoke(*(subst.get(a, a) for a in args))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("reprolane: error: ")
    assert message in lines[0]
    assert h.opened == 0


def test_record_golden_from_a_workload_then_gate_it(h: Harness) -> None:
    workload = h.tmp / "work.jsonl"
    prompts = [list(e.prompt.token_ids) for e in h.envelopes]  # type: ignore[union-attr]
    workload.write_text(
        "".join(json.dumps({"prompt_token_ids": p, "request_id": f"w-{i}"}) + "\n" for i, p in enumerate(prompts))
    )
    out = h.tmp / "recorded.jsonl"
    result = h.invoke("record-golden", "--output", str(out), "--workload-file", str(workload), "--lane", "remote")
    assert result.exit_code == 0, result.output
    golden = load_golden_file(out)
    assert [e.request_id for e in golden.envelopes] == ["w-0", "w-1", "w-2"]
    assert all(e.runtime == LANE_FINGERPRINT for e in golden.envelopes)
    fp = golden_environment(golden)
    cand = h.tmp / "cand.json"
    cand.write_text(
        fp.model_copy(update={"runtime": fp.runtime.model_copy(update={"dtype": "float32"})}).model_dump_json()
    )
    gated = h.invoke("--baseline", "golden", "--candidate", str(cand), "--golden", str(out))
    assert gated.exit_code == 0, gated.output
    assert "Replayed 3 on lane fake" in gated.stdout


def test_record_golden_needs_exactly_one_source(h: Harness) -> None:
    result = h.invoke("record-golden", "--output", str(h.tmp / "x.jsonl"))
    assert result.exit_code == 2
    assert "exactly one of --from-s3 or --workload-file" in result.stderr


def test_record_golden_from_s3_and_gate_by_selector(h: Harness) -> None:
    with moto_s3() as s3:
        client = s3.client()
        for env in h.envelopes:
            seed_envelope(client, s3.bucket, env)
        h.store = EnvelopeStore(client, s3.bucket)
        out = h.tmp / "from-s3.jsonl"
        tenant = h.envelopes[0].tenant
        result = h.invoke("record-golden", "--output", str(out), "--from-s3", f"s3:tenant={tenant}")
        assert result.exit_code == 0, result.output
        assert {e.request_id for e in load_golden_file(out).envelopes} == {e.request_id for e in h.envelopes}
        cand = h.fingerprint("cand.json", engine_version="0.33.0")
        ids = ",".join(e.request_id for e in h.envelopes[:2])
        gated = h.invoke("--baseline", "golden", "--candidate", str(cand), "--golden", f"s3:request-ids={ids}")
        assert gated.exit_code == 0, gated.output
        assert "Replayed 2" in gated.stdout


def test_statistical_mode_through_the_cli(h: Harness) -> None:
    cases = h.tmp / "cases.jsonl"
    case = VendorCase(
        request_id="v-1", endpoint="chat.completions", body={"model": "m", "messages": []},
        recorded_text="Paris.", model_alias="m", versions={"model": "m-1"},
    )  # fmt: skip
    cases.write_text(case.model_dump_json() + "\n")
    checks = h.tmp / "assert.json"
    checks.write_text(json.dumps({"v-1": [{"contains": "Paris"}, {"max_length": 5}]}))
    report = h.tmp / "stat.json"
    args = ["--statistical", "--golden", str(cases), "--upstream", "http://vendor", "--samples", "3"]
    result = h.invoke(*args, "--assertions", str(checks), "--report", str(report))
    assert result.exit_code == 1, result.output  # max_length 5 fails every sample
    data = json.loads(report.read_text())
    assert data["mode"] == "statistical"
    assert data["cases"][0]["assertion_pass_rate"] == 0.5
    assert data["cases"][0]["version_changed"] is True
    ok = h.invoke(*args, "--assertions", str(checks), "--min-assertion-rate", "0.5")
    assert ok.exit_code == 0, ok.output


def test_gate_is_registered_on_the_root_cli(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        root_app,
        ["release", "gate", "--golden", str(tmp_path / "none.jsonl"), "--baseline", "golden", "--candidate", "local"],
    )
    assert result.exit_code == 2
    assert "cannot read golden set" in result.stderr


def test_record_golden_vendor_cases_then_gate_them_statistically(h: Harness) -> None:
    workload = h.tmp / "vendor.jsonl"
    workload.write_text(
        json.dumps({"request_id": "v-9", "model": "m", "messages": [{"role": "user", "content": "?"}], "seed": 1})
        + "\n"
    )
    out = h.tmp / "cases.jsonl"
    result = h.invoke(
        "record-golden", "--output", str(out), "--workload-file", str(workload), "--vendor", "--upstream", "http://v"
    )
    assert result.exit_code == 0, result.output
    case = VendorCase.model_validate_json(out.read_text().splitlines()[0])
    assert (case.request_id, case.endpoint, case.recorded_text) == ("v-9", "chat.completions", "Paris, of course.")
    assert case.versions == {"model": "m-2"}
    assert case.body["max_tokens"] == 16
    gated = h.invoke("--statistical", "--golden", str(out), "--upstream", "http://v", "--samples", "2")
    assert gated.exit_code == 0, gated.output
    assert "1/1 case(s) passed" in gated.stdout


IMAGE = "ghcr.io/acme/vllm:0.33.0@sha256:" + "cd" * 32


def test_a_pass_records_the_environment_and_a_later_fail_names_it_as_rollback(h: Harness) -> None:
    good = h.fingerprint("good.json", engine_version="0.33.0")
    passed = h.invoke(
        "--baseline", "golden", "--candidate", str(good), "--golden", str(h.golden), "--deployment", "prod",
        "--image", IMAGE, "--engine-args", "--dtype bfloat16 --max-num-seqs 8",
    )  # fmt: skip
    assert passed.exit_code == 0, passed.output
    [(key, rec)] = h.history.records.items()
    assert "Recorded known-good environment" in passed.stdout
    assert key in passed.stdout
    assert rec.deployment == "prod"
    assert rec.environment.runtime.engine_version == "0.33.0"
    assert rec.image is not None
    assert rec.image.digest == "sha256:" + "cd" * 32
    assert rec.engine_args == ("--dtype", "bfloat16", "--max-num-seqs", "8")
    assert (rec.gate.total, rec.gate.passed, rec.gate.lane) == (3, 3, "fake")

    h.lane.perturb[tuple(h.envelopes[0].prompt.token_ids)] = 0  # type: ignore[union-attr]
    bad = h.fingerprint("bad.json", engine_version="0.34.0")
    report = h.tmp / "fail.json"
    failed = h.invoke(
        "--baseline", "golden", "--candidate", str(bad), "--golden", str(h.golden), "--deployment", "prod",
        "--report", str(report),
    )  # fmt: skip
    assert failed.exit_code == 1, failed.output
    assert f"Last known-good environment (prod): {rec.environment_sha256}" in failed.stdout
    assert "ghcr.io/acme/vllm@sha256:" + "cd" * 32 in failed.stdout
    assert "--dtype bfloat16 --max-num-seqs 8" in failed.stdout
    data = json.loads(report.read_text())
    assert data["rollback"]["environment_sha256"] == rec.environment_sha256
    assert data["deployment"] == "prod"
    assert len(h.history.records) == 1  # a fail records nothing

    other = h.invoke("--baseline", "golden", "--candidate", str(bad), "--golden", str(h.golden))
    assert other.exit_code == 1
    assert "no known-good environment recorded for deployment 'default' yet" in other.stdout


def test_no_known_good_neither_records_nor_names(h: Harness) -> None:
    same = h.fingerprint("same.json")
    result = h.invoke("--baseline", "golden", "--candidate", str(same), "--golden", str(h.golden), "--no-known-good")
    assert result.exit_code == 0, result.output
    assert h.history.records == {}
    assert "known-good" not in result.stdout


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--image", "Not An Image", "--image"),
        ("--deployment", "../x", "--deployment"),
        ("--engine-args", '"x', "--engine-args"),
    ],
)
def test_bad_known_good_options_exit_2(h: Harness, flag: str, value: str, message: str) -> None:
    same = h.fingerprint("same.json")
    result = h.invoke("--baseline", "golden", "--candidate", str(same), "--golden", str(h.golden), flag, value)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert h.history.records == {}


def test_without_any_s3_settings_the_gate_says_it_records_nothing(h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.release.gate_cli import audit_history

    for name in ("REPROLANE_REPLAYER_S3_ENDPOINT", "REPROLANE_REPLAYER_S3_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("REPROLANE_RUN_DIR", str(h.tmp / "no-stack"))
    assert audit_history(ReplayerSettings()) is None
    same = h.fingerprint("same.json")
    gate = build_gate_app(lane_factory=h.factory)
    result = CliRunner().invoke(
        build_app({"gate": gate}),
        ["release", "gate", "--baseline", "golden", "--candidate", str(same), "--golden", str(h.golden)],
    )
    assert result.exit_code == 0, result.output
    assert "no audit bucket configured" in result.stderr
