"""`reprolane release fingerprint` and `fingerprint diff`: real CLI, real model cache, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.root import app
from infra.paths import model_dir

runner = CliRunner()
RUNTIME = Path(__file__).parents[3] / "infra" / "runtime" / "vllm-cpu.json"


@pytest.mark.model
def test_local_fingerprint_names_model_engine_and_device(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    result = runner.invoke(app, ["release", "fingerprint", "--runtime-file", str(RUNTIME), "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    manifest = json.loads((model_dir() / "reprolane-manifest.json").read_text())
    assert data["artifacts"]["model_sha256"] == manifest["model_sha256"]
    assert data["artifacts"]["chat_template_sha256"] == manifest["chat_template_sha256"]
    assert data["runtime"]["engine"] == "vllm"
    assert data["runtime"]["engine_version"]
    assert data["runtime"]["torch_version"].startswith("2.")
    assert data["runtime"]["device"] == "cpu"
    assert data["runtime"]["dtype"] == "bfloat16"


@pytest.mark.model
def test_diff_exit_codes(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    assert runner.invoke(app, ["release", "fingerprint", "--runtime-file", str(RUNTIME), "-o", str(a)]).exit_code == 0
    same = runner.invoke(app, ["release", "fingerprint", "diff", str(a), str(a)])
    assert same.exit_code == 0
    assert "identical" in same.output
    data = json.loads(a.read_text())
    data["runtime"]["dtype"] = "float32"
    data["runtime"]["tensor_parallel_size"] = 2
    b = tmp_path / "b.json"
    b.write_text(json.dumps(data))
    changed = runner.invoke(app, ["release", "fingerprint", "diff", str(a), str(b)])
    assert changed.exit_code == 1
    assert "runtime.dtype" in changed.output
    assert "runtime.tensor_parallel_size" in changed.output


def test_diff_of_bad_file_is_exit_2_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "reprolane.fingerprint/1", "artifacts": {}, "runtime": {"engine": ""}}')
    result = runner.invoke(app, ["release", "fingerprint", "diff", str(bad), str(bad)])
    assert result.exit_code == 2
    assert "runtime.engine" in result.output


@pytest.mark.model
def test_bad_runtime_file_names_the_field(tmp_path: Path) -> None:
    rt = tmp_path / "rt.json"
    rt.write_text('{"dtpye": "bfloat16"}')
    result = runner.invoke(app, ["release", "fingerprint", "--runtime-file", str(rt)])
    assert result.exit_code == 1
    assert "dtpye" in result.output
    assert "Traceback" not in result.output
