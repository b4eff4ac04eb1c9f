"""Artifact hashes from the manifest, runtime fields from the runtime file, the fingerprint cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capture.errors import CaptureError
from capture.protocol.sampling import VLLM_DEFAULTS
from capture.request.edge import RecentIds
from capture.request.runtime import RuntimeProbe, load_artifacts, load_runtime_file, load_sampling_defaults
from tests.factories import manifest_doc


def test_artifacts_from_manifest(tmp_path: Path) -> None:
    path = tmp_path / "reprolane-manifest.json"
    path.write_text(
        json.dumps(manifest_doc(model_sha256="a" * 64, tokenizer_sha256="b" * 64, chat_template_sha256="c" * 64))
    )
    got = load_artifacts(path)
    assert (got.model_sha256, got.tokenizer_sha256, got.chat_template_sha256) == ("a" * 64, "b" * 64, "c" * 64)
    assert got.manifest_source == str(path)


def test_no_manifest_means_unknown_hashes() -> None:
    assert load_artifacts(None).model_sha256 is None


def test_bad_manifest_hash_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(manifest_doc(model_sha256="xyz")))
    with pytest.raises(CaptureError, match="model_sha256"):
        load_artifacts(path)


def test_runtime_file_validated(tmp_path: Path) -> None:
    good = tmp_path / "rt.json"
    good.write_text(json.dumps({"dtype": "bfloat16", "device": "cpu", "tensor_parallel_size": 1}))
    assert load_runtime_file(good)["dtype"] == "bfloat16"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"dtyp": "bfloat16"}))
    with pytest.raises(CaptureError, match="dtyp"):
        load_runtime_file(bad)


def test_fingerprint_merges_observed_and_file() -> None:
    probe = RuntimeProbe({"dtype": "bfloat16", "engine_version": "0.1.0"})
    fp = probe.fingerprint("vllm-0.32.0-a7512781")
    assert fp.engine == "vllm"
    assert fp.engine_version == "0.32.0"  # observed beats the file
    assert fp.dtype == "bfloat16"
    assert fp.system_fingerprint == "vllm-0.32.0-a7512781"
    assert probe.fingerprint("vllm-0.32.0-a7512781") is fp
    unknown = RuntimeProbe({}).fingerprint(None)
    assert unknown.engine == "unknown"
    assert unknown.engine_version is None


def test_recent_ids_are_bounded() -> None:
    ids = RecentIds(capacity=3)
    for i in range(10):
        ids.add(f"r{i}")
    assert len(ids) == 3
    assert "r9" in ids
    assert "r0" not in ids


def _manifest(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "reprolane-manifest.json"
    path.write_text(json.dumps(doc))
    return path


def test_sampling_defaults_as_vllm_computes_them(tmp_path: Path) -> None:
    path = _manifest(tmp_path, manifest_doc(generation_defaults={"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}))
    auto = load_sampling_defaults(path, "auto", {})
    assert auto.values == {**VLLM_DEFAULTS, "temperature": 0.6, "top_p": 0.9, "max_tokens": 64}
    assert load_sampling_defaults(path, "vllm", {}).values == VLLM_DEFAULTS  # --generation-config vllm
    assert load_sampling_defaults(None, "auto", {}).values == VLLM_DEFAULTS
    # --override-generation-config wins over the model's; Hugging Face names, as vLLM reads that flag
    over = load_sampling_defaults(path, "auto", {"temperature": 0.2, "max_new_tokens": 8, "max_tokens": 99})
    assert (over.values["temperature"], over.values["max_tokens"], over.values["top_p"]) == (0.2, 8, 0.9)
    assert load_sampling_defaults(path, "vllm", {"top_k": 5}).values == {**VLLM_DEFAULTS, "top_k": 5}


def test_a_manifest_without_generation_defaults_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    doc = manifest_doc(manifest_version=2)
    del doc["generation_defaults"]
    path = _manifest(tmp_path, doc)
    assert load_sampling_defaults(path, "auto", {}).values == VLLM_DEFAULTS
    assert "no generation_defaults" in caplog.text


@pytest.mark.parametrize(
    ("doc", "overrides", "named"),
    [
        (manifest_doc(generation_defaults={"temperature": "hot"}), {}, "generation_defaults.temperature"),
        (manifest_doc(generation_defaults=[1]), {}, "generation_defaults: Input should be an object"),
        (manifest_doc(generation_defaults={"top_k": True}), {}, "generation_defaults.top_k"),
        (manifest_doc(), {"top_p": None}, "upstream_override_generation_config: top_p"),
    ],
)
def test_bad_sampling_defaults_name_the_field(
    tmp_path: Path, doc: dict[str, object], overrides: dict[str, object], named: str
) -> None:
    with pytest.raises(CaptureError, match=named):
        load_sampling_defaults(_manifest(tmp_path, doc), "auto", overrides)  # type: ignore[arg-type]
