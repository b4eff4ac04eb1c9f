"""A captured request answered whole: audit fields stripped and recorded, upstream's failures relayed and recorded."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from capture.request.app import build_app
from capture.settings import CaptureSettings
from schemas import CapturedError, CapturedOutput
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import (
    ERROR_400,
    FINGERPRINT,
    OUTPUT_IDS,
    OUTPUT_TEXT,
    PROMPT_IDS,
    FakeUpstream,
    serve,
)
from tests.capture.support import CHAT, MODEL, finished, only, sidecar, upstream_calls


@pytest.mark.parametrize("mode", ["guaranteed", "best_effort"])  # best_effort collects after the answer is sent
async def test_chat_non_stream_strips_audit_fields_and_records_them(mode: str) -> None:
    async with sidecar(mode=mode) as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    doc = resp.json()
    assert doc["choices"][0]["message"]["content"] == "The capital."
    assert doc["choices"][0]["logprobs"] is None
    assert doc["choices"][0]["token_ids"] is None
    assert doc["prompt_token_ids"] is None
    sent = upstream_calls(upstream, "/v1/chat/completions")[0]
    assert sent["return_token_ids"] is True
    assert sent["logprobs"] is True
    assert sent["top_logprobs"] == 5
    assert sent["return_tokens_as_token_ids"] is True
    env = only(spool)
    assert resp.headers["x-reprolane-request-id"] == env.request_id
    assert env.endpoint == "chat.completions"
    assert env.model == MODEL
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == PROMPT_IDS
    assert env.prompt.source == "upstream"
    assert env.request_body_sha256 == hashlib.sha256(resp.request.content).hexdigest()
    assert isinstance(env.outcome, CapturedOutput)
    choice = env.outcome.choices[0]
    assert list(choice.token_ids) == OUTPUT_IDS
    assert choice.text == "The capital."
    assert choice.logprobs is not None
    assert [s.token_id for s in choice.logprobs] == OUTPUT_IDS
    assert choice.logprobs[0].token == "The"
    assert [c.token_id for c in choice.logprobs[1].top] == [3575, 3576, 3577, 3578, 3579]
    # the "token_id:N" form the sidecar asked upstream for is never stored as a token's text
    assert [c.token for c in choice.logprobs[1].top] == ["", "", "", "", ""]
    assert [c.rank for c in choice.logprobs[1].top] == [1, 2, 3, 4, 5]
    assert env.outcome.usage["completion_tokens"] == 3
    assert env.sampling is not None
    assert (env.sampling.temperature, env.sampling.top_p, env.sampling.top_k) == (1.0, 1.0, 0)
    if mode == "guaranteed":  # a sampled request without a seed gets one by default: its record is replayable
        assert (env.sampling.seed_scope, env.sampling.seed_injected) == ("per_request", True)
        assert env.sampling.seed == sent["seed"]
    else:
        assert env.sampling.seed_scope == "worker_global"
        assert env.sampling.seed is None
        assert "seed" not in sent
    assert env.sampling.logprobs == 5
    assert env.runtime.engine == "vllm"
    assert env.runtime.engine_version == "0.32.0"
    assert env.runtime.system_fingerprint == FINGERPRINT
    assert env.outcome.timings.upstream_ms > 0.0
    assert env.context.in_flight_at_start == 1
    assert env.context.stream is False


async def test_client_logprobs_and_token_ids_are_kept_as_asked() -> None:
    body = {**CHAT, "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "temperature": 0}
    async with sidecar() as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", json=body)
    doc = resp.json()
    assert doc["choices"][0]["token_ids"] == OUTPUT_IDS
    assert doc["prompt_token_ids"] == PROMPT_IDS
    assert [len(s["top_logprobs"]) for s in doc["choices"][0]["logprobs"]["content"]] == [2, 2, 2]
    assert doc["choices"][0]["logprobs"]["content"][0]["token"] == "tok504"
    sent = upstream_calls(upstream, "/v1/chat/completions")[0]
    assert sent["top_logprobs"] == 2
    assert "return_tokens_as_token_ids" not in sent
    env = only(spool)
    assert env.sampling is not None
    assert env.sampling.logprobs == 2
    assert env.sampling.seed_scope == "none"
    assert isinstance(env.outcome, CapturedOutput)
    steps = env.outcome.choices[0].logprobs
    assert steps is not None
    assert steps[0].top[0].token == "tok504"
    assert steps[0].top[0].token_id is None


async def test_completions_non_stream_records_ids_from_choice() -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    async with sidecar() as (client, upstream, spool, _):
        resp = await client.post("/v1/completions", json=body)
    choice = resp.json()["choices"][0]
    assert choice["logprobs"] is None
    assert choice["token_ids"] is None
    assert choice["prompt_token_ids"] is None
    assert upstream_calls(upstream, "/v1/completions")[0]["logprobs"] == 5
    env = only(spool)
    assert isinstance(env.outcome, CapturedOutput)
    steps = env.outcome.choices[0].logprobs
    assert steps is not None
    assert steps[0].token is None
    assert steps[0].top[1].token_id == 505


async def test_upstream_400_is_relayed_and_recorded_with_tokenized_prompt() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "error400"}], "temperature": -1}
    async with sidecar() as (client, _, spool, _m):
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert resp.json() == ERROR_400
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert (env.outcome.error_type, env.outcome.status_code) == ("bad_request", 400)
    assert env.sampling is None  # temperature -1 is outside the contract
    assert env.prompt is not None
    assert env.prompt.source == "tokenize"


async def test_upstream_500_is_relayed_as_upstream_error() -> None:
    async with sidecar() as (client, _, spool, _m):
        resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": "error500", "stream": True})
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == "boom"
    env = finished(spool)  # a stream request: its started record came first
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "upstream_error"


async def test_upstream_timeout_is_504_and_timeout_envelope() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    async with sidecar(upstream_timeout_s=0.3) as (client, _, spool, _m):
        resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == 504
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "timeout"
    assert env.outcome.timings.upstream_ms >= 250.0  # the call's time is recorded when it fails, too


async def test_upstream_unreachable_is_502() -> None:
    spool = FakeSpool()
    settings = CaptureSettings(upstream="http://127.0.0.1:9", spool_max_bytes=1 << 20)
    async with serve(build_app(settings, spool=spool)) as url, httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 502
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "upstream_error"
    assert env.runtime.engine == "unknown"


async def test_client_disconnect_while_waiting_non_stream() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    async with sidecar() as (client, _upstream, spool, _m):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=body, timeout=0.3)
        envs = await spool.wait_for(1)
    assert isinstance(envs[0].outcome, CapturedError)
    assert envs[0].outcome.error_type == "client_disconnect"
    assert envs[0].outcome.timings.upstream_ms >= 250.0  # and when the client's hang-up cancels it


async def test_tokenize_fallback_when_upstream_has_no_prompt_ids() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "noids"}]}
    async with sidecar() as (client, upstream, spool, _m):
        await client.post("/v1/chat/completions", json=body)
    env = only(spool)
    assert env.prompt is not None
    assert env.prompt.source == "tokenize"
    assert list(env.prompt.token_ids) == PROMPT_IDS
    tok = upstream_calls(upstream, "/tokenize")[0]
    assert tok["messages"] == body["messages"]
    assert tok["add_generation_prompt"] is True


async def test_vendor_upstream_records_model_and_version_headers() -> None:
    """A hosted API without /version: the resolved model name and version headers become vendor_version."""
    async with sidecar(upstream=FakeUpstream(vendor=True)) as (client, _, spool, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200
    runtime = only(spool).runtime
    assert runtime.engine == "unknown"
    assert runtime.vendor_version == f"model={MODEL}-2026-01-01;openai-version=2020-10-01"


async def test_vllm_upstream_has_no_vendor_version() -> None:
    async with sidecar() as (client, _, spool, _):
        await client.post("/v1/chat/completions", json=CHAT)
    runtime = only(spool).runtime
    assert runtime.engine == "vllm"
    assert runtime.vendor_version is None


async def test_several_prompts_without_each_prompts_ids_record_no_prompt() -> None:
    """The fake upstream gives prompt ids for choice 0 only: recording them as the request's prompt would
    have a replay compare the second prompt's answer with the first prompt's."""
    body = {"model": MODEL, "prompt": ["The capital of France is", "Water boils at"], "max_tokens": 3}
    async with sidecar() as (client, _upstream, spool, _):
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    env = only(spool)
    assert env.prompt is None
    assert env.more_prompts is None
    assert not env.replayable


async def test_echo_of_token_ids_upstream_cannot_detokenize_asks_for_no_token_ids() -> None:
    body = {"model": MODEL, "prompt": [504, 6376, 314], "max_tokens": 3, "echo": True}
    async with sidecar() as (client, upstream, _spool, _):
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    (sent,) = upstream_calls(upstream, "/v1/completions")
    assert "return_token_ids" not in sent  # upstream echoes the prompt itself: nothing to put back
    assert resp.json()["choices"][0]["text"] == "".join(OUTPUT_TEXT)  # as upstream wrote it, nothing added
