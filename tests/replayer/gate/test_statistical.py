"""The statistical (vendor) gate with a fake sampler and a stub similarity; `HttpSampler` over a mock transport."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from replayer.errors import GateInputError
from replayer.gate.statistical import (
    Assertion,
    Sample,
    VendorCase,
    case_from_envelope,
    load_assertions,
    load_cases,
    render_statistical,
    run_statistical_gate,
)
from replayer.gate.vendor_client import HttpSampler
from schemas import SamplingContract
from tests.replayer.support import make_envelope

CASE = VendorCase(
    request_id="v-1",
    endpoint="chat.completions",
    body={"model": "gpt-x", "messages": [{"role": "user", "content": "Capital of France?"}], "seed": 3},
    recorded_text="The capital of France is Paris.",
    model_alias="gpt-x",
    versions={"model": "gpt-x-2026-01-01"},
)


def stub_similarity(a: str, b: str) -> float:
    """Word-set Jaccard: paraphrases with the same words score high, garbage scores 0."""
    wa, wb = set(a.lower().strip(".").split()), set(b.lower().strip(".").split())
    return len(wa & wb) / len(wa | wb) if wa | wb else 1.0


@dataclass
class ScriptedSampler:
    texts: list[str]
    versions: dict[str, str] = field(default_factory=lambda: {"model": "gpt-x-2026-01-01"})
    fail_every: int = 0
    calls: int = 0

    def sample(self, case: VendorCase) -> Sample:
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise GateInputError("upstream answered 503")
        return Sample(text=self.texts[(self.calls - 1) % len(self.texts)], versions=self.versions)


PARAPHRASES = ["The capital of France is Paris.", "Paris is the capital of France.", "the capital of France is Paris"]


def gate(sampler: ScriptedSampler, **kw: Any) -> Any:
    return run_statistical_gate([CASE], sampler, stub_similarity, golden="g.jsonl", candidate="http://x", **kw)


def test_paraphrases_pass() -> None:
    sampler = ScriptedSampler(PARAPHRASES)
    report = gate(sampler, samples=3, assertions={"v-1": [Assertion(contains="Paris")]}, min_similarity=0.9)
    assert report.gate_passed
    case = report.cases[0]
    assert sampler.calls == 3
    assert case.similarities == (1.0, 1.0, 1.0)
    assert (case.assertion_passes, case.assertion_checks) == (3, 3)
    assert not case.version_changed
    assert "PASS" in render_statistical(report)


def test_garbage_fails_on_similarity() -> None:
    report = gate(ScriptedSampler(["zzz qqq", "lorem ipsum"]), samples=4, min_similarity=0.5)
    assert not report.gate_passed
    assert report.cases[0].mean_similarity == 0.0
    assert report.cases[0].assertion_pass_rate is None  # no assertions declared: similarity alone decides


def test_assertions_fail_a_similar_answer() -> None:
    checks = {"v-1": [Assertion(not_contains="Paris"), Assertion(max_length=100)]}
    report = gate(ScriptedSampler(PARAPHRASES), samples=3, assertions=checks, min_similarity=0.5)
    case = report.cases[0]
    assert not report.gate_passed
    assert case.assertion_pass_rate == 0.5
    assert case.failed_assertions == {"not_contains='Paris'": 3}
    assert "assertion not_contains='Paris' failed on 3 sample(s)" in render_statistical(report)
    relaxed = gate(ScriptedSampler(PARAPHRASES), samples=3, assertions=checks, min_assertion_rate=0.5)
    assert relaxed.gate_passed


def test_missing_samples_count_against_the_case() -> None:
    report = gate(
        ScriptedSampler(PARAPHRASES, fail_every=2), samples=4, assertions={"v-1": [Assertion(contains="Paris")]}
    )
    case = report.cases[0]
    assert case.errors == ("upstream answered 503", "upstream answered 503")
    assert case.mean_similarity == 0.5  # two samples of 1.0 over four requested
    assert (case.assertion_passes, case.assertion_checks) == (2, 4)
    assert not report.gate_passed


def test_a_changed_vendor_version_is_reported() -> None:
    report = gate(ScriptedSampler(PARAPHRASES, versions={"model": "gpt-x-2026-06-01"}), samples=2)
    assert report.gate_passed
    assert report.versions_changed == 1
    assert report.cases[0].observed_versions == {"model": ("gpt-x-2026-06-01",)}
    assert "recorded {'model': 'gpt-x-2026-01-01'}" in render_statistical(report)


def test_assertions_for_unknown_requests_are_bad_input() -> None:
    with pytest.raises(GateInputError, match="nope"):
        gate(ScriptedSampler(PARAPHRASES), assertions={"nope": [Assertion(contains="x")]})


@pytest.mark.parametrize(
    ("assertion", "text", "holds"),
    [
        (Assertion(contains="Paris"), "in Paris", True),
        (Assertion(contains="Paris"), "in paris", False),
        (Assertion(not_contains="London"), "in Paris", True),
        (Assertion(regex=r"\bParis\b"), "Paris.", True),
        (Assertion(regex=r"^\d+$"), "12a", False),
        (Assertion(max_length=3), "abc", True),
        (Assertion(max_length=3), "abcd", False),
        (Assertion(json_valid=True), '{"a": 1}', True),
        (Assertion(json_valid=True), "{a: 1}", False),
        (Assertion(json_valid=False), "plain", True),
    ],
)
def test_assertion_kinds(assertion: Assertion, text: str, holds: bool) -> None:
    assert assertion.check(text) is holds


def test_assertion_must_set_one_valid_field(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        Assertion(contains="a", regex="b")
    with pytest.raises(ValidationError, match="regex"):
        Assertion(regex="(")
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"v-1": [{"contains": "Paris"}, {"json_valid": True}]}))
    assert load_assertions(path) == {"v-1": (Assertion(contains="Paris"), Assertion(json_valid=True))}
    path.write_text(json.dumps({"v-1": [{"colour": "red"}]}))
    with pytest.raises(GateInputError, match=r"\[v-1\]"):
        load_assertions(path)
    path.write_text("[]")
    with pytest.raises(GateInputError, match="request_id -> list"):
        load_assertions(path)


def test_cases_from_jsonl_accept_envelopes_without_their_seed(tmp_path: Path) -> None:
    env = make_envelope(
        1, sampling=SamplingContract(temperature=0.7, top_p=0.9, max_tokens=8, seed=42, seed_scope="per_request")
    )
    case = case_from_envelope(env)
    assert case.endpoint == "completions"
    assert case.body["prompt"] == list(env.prompt.token_ids)  # type: ignore[union-attr]
    assert "seed" not in case.body
    assert (case.body["temperature"], case.body["top_p"], case.body["max_tokens"]) == (0.7, 0.9, 8)
    assert case.versions == {"system_fingerprint": "vllm-0.32.0-1a2b3c4d", "engine_version": "0.32.0"}
    path = tmp_path / "cases.jsonl"
    path.write_text(CASE.model_dump_json() + "\n" + env.canonical().decode() + "\n")
    assert load_cases(path) == (CASE, case)
    path.write_text('{"request_id": "x"}\n')
    with pytest.raises(GateInputError, match="line 1"):
        load_cases(path)


def test_http_sampler_drops_the_seed_and_records_version_identifiers() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append({"path": request.url.path, "body": json.loads(request.content)})
        return httpx.Response(
            200,
            json={
                "model": "gpt-x-2026-06-01",
                "system_fingerprint": "fp_abc",
                "choices": [{"message": {"role": "assistant", "content": "Paris."}}],
            },
            headers={"openai-version": "2020-10-01", "x-model-version": "7"},
        )

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://vendor")
    sample = HttpSampler("http://vendor", client=client, model="gpt-y").sample(CASE)
    assert sample.text == "Paris."
    assert sample.versions == {
        "model": "gpt-x-2026-06-01",
        "system_fingerprint": "fp_abc",
        "header:openai-version": "2020-10-01",
        "header:x-model-version": "7",
    }
    assert seen[0]["path"] == "/v1/chat/completions"
    assert "seed" not in seen[0]["body"]
    assert seen[0]["body"]["model"] == "gpt-y"
    assert seen[0]["body"]["stream"] is False


def test_http_sampler_errors_are_translated() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "slow down"}})

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://vendor")
    with pytest.raises(GateInputError, match="429"):
        HttpSampler("http://vendor", client=client).sample(CASE)

    def no_choices(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": []})

    client = httpx.Client(transport=httpx.MockTransport(no_choices), base_url="http://vendor")
    with pytest.raises(GateInputError, match="without choices"):
        HttpSampler("http://vendor", client=client).sample(CASE)
    with pytest.raises(GateInputError, match="unreachable"):
        HttpSampler("http://127.0.0.1:1", timeout_s=2).sample(CASE)
