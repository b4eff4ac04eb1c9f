"""The sidecar's HTTP edge against a fake vLLM-shaped upstream, both served on real loopback sockets."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from capture.app import build_app
from capture.metrics import CaptureMetrics
from capture.settings import CaptureSettings
from schemas import CapturedError, CapturedOutput, Envelope
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

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@contextlib.asynccontextmanager
async def sidecar(
    spool: FakeSpool | None = None, upstream: FakeUpstream | None = None, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeUpstream, FakeSpool, CaptureMetrics]]:
    upstream = upstream or FakeUpstream()
    spool = spool or FakeSpool()
    metrics = CaptureMetrics()
    async with serve(upstream.app()) as up_url:
        settings = CaptureSettings(upstream=up_url, spool_max_bytes=1 << 20, **overrides)
        app = build_app(settings, spool=spool, metrics=metrics)
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            yield client, upstream, spool, metrics
    assert spool.opened
    assert spool.closed


def upstream_calls(upstream: FakeUpstream, path: str) -> list[dict[str, Any]]:
    return [s.body or {} for s in upstream.seen if s.path == path]


def only(spool: FakeSpool) -> Envelope:
    assert len(spool.envelopes) == 1, spool.envelopes
    return spool.envelopes[0]


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
    assert env.sampling.seed_scope == "worker_global"
    assert env.sampling.seed is None
    assert env.sampling.logprobs == 5
    assert env.runtime.engine == "vllm"
    assert env.runtime.engine_version == "0.32.0"
    assert env.runtime.system_fingerprint == FINGERPRINT
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


async def test_chat_stream_chunks_are_stripped_and_recorded() -> None:
    async with sidecar() as (client, _, spool, _m):
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            raw = (await resp.aread()).decode()
            rid = resp.headers["x-reprolane-request-id"]
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] is None
    for chunk in chunks[1:]:
        assert chunk["choices"][0]["logprobs"] is None
        assert chunk["choices"][0]["token_ids"] is None
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "The capital."
    env = only(spool)
    assert env.request_id == rid
    assert env.context.stream is True
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == PROMPT_IDS
    assert isinstance(env.outcome, CapturedOutput)
    assert list(env.outcome.choices[0].token_ids) == OUTPUT_IDS
    assert env.outcome.choices[0].finish_reason == "stop"
    assert env.outcome.timings.first_token_ms is not None
    assert env.runtime.system_fingerprint == FINGERPRINT


async def test_completions_stream_with_client_logprobs() -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "stream": True, "logprobs": 1}
    async with sidecar() as (client, _, spool, _m):
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            raw = (await resp.aread()).decode()
    chunks = [json.loads(e[len("data: ") :]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None for c in chunks)
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["tok504"]
    env = only(spool)
    assert env.endpoint == "completions"
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == PROMPT_IDS
    assert isinstance(env.outcome, CapturedOutput)
    steps = env.outcome.choices[0].logprobs
    assert steps is not None
    assert [s.token_id for s in steps] == OUTPUT_IDS
    assert steps[2].logprob == -0.125


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


async def test_other_paths_pass_through_without_envelope() -> None:
    async with sidecar() as (client, _upstream, spool, _):
        resp = await client.get("/v1/models?x=1")
        version = await client.get("/version")
    assert resp.status_code == 200
    assert resp.json()["data"][0]["id"] == "fake-model"
    assert resp.headers["x-upstream"] == "yes"
    assert version.json() == {"version": "0.32.0"}
    assert spool.envelopes == []


async def test_body_over_limit_is_413_without_contacting_upstream() -> None:
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    async with sidecar(max_body_bytes=1024) as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", json=big)
    assert resp.status_code == 413
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "1024" in err["message"]
    assert upstream_calls(upstream, "/v1/chat/completions") == []
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "bad_request"
    assert env.outcome.status_code == 413
    assert env.prompt is None
    assert env.sampling is None
    assert env.request_id == resp.headers["x-reprolane-request-id"]


async def test_malformed_json_is_400_and_recorded_with_body_hash() -> None:
    raw = b'{"model": "fake-model", "messages": ['
    async with sidecar() as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert upstream_calls(upstream, "/v1/chat/completions") == []
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "bad_request"
    assert env.request_body_sha256 == hashlib.sha256(raw).hexdigest()


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
    env = only(spool)
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


async def test_client_disconnect_mid_stream_is_recorded_and_upstream_aborted() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "drip"}], "stream": True}
    async with sidecar() as (client, upstream, spool, _m):
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = resp.aiter_lines()
            seen = 0
            async for line in lines:
                seen += line.startswith("data: ")
                if seen == 3:
                    break
        envs = await spool.wait_for(1)
        for _ in range(50):
            if upstream.aborted:
                break
            await asyncio.sleep(0.05)
    env = envs[0]
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "client_disconnect"
    assert env.outcome.partial
    assert len(env.outcome.partial[0].token_ids) >= 2
    assert upstream.aborted >= 1


async def test_in_flight_gauge_counts_a_request_waiting_on_upstream() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    async with sidecar(upstream_timeout_s=1.0) as (client, _upstream, _spool, metrics):
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        for _ in range(100):
            await client.get("/metrics")
            if metrics.value("reprolane_capture_in_flight") == 1.0:
                break
            await asyncio.sleep(0.01)
        assert metrics.value("reprolane_capture_in_flight") == 1.0
        assert (await waiting).status_code == 504
        assert metrics.value("reprolane_capture_in_flight") == 0.0


async def test_client_disconnect_while_waiting_non_stream() -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "slow"}]}
    async with sidecar() as (client, _upstream, spool, _m):
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=body, timeout=0.3)
        envs = await spool.wait_for(1)
    assert isinstance(envs[0].outcome, CapturedError)
    assert envs[0].outcome.error_type == "client_disconnect"


async def test_request_id_rules() -> None:
    async with sidecar() as (client, _, spool, _m):
        a = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "order-42"})
        b = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "order-42"})
        c = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "bad id with spaces"})
    ids = [r.headers["x-reprolane-request-id"] for r in (a, b, c)]
    assert ids[0] == "order-42"
    assert ids[1] != "order-42"
    assert ids[2] != "bad id with spaces"
    assert len(set(ids)) == 3
    assert [e.request_id for e in spool.envelopes] == ids


async def test_secret_headers_forwarded_not_recorded_and_reprolane_headers_stripped() -> None:
    headers = {
        "Authorization": "Bearer sekrit-token",
        "X-Api-Key": "sekrit-key",
        "X-Reprolane-Tenant": "acme",
        "X-Reprolane-Workflow-Id": "claim-7",
        "X-Reprolane-Step": "3",
        "X-Reprolane-Flag": "true",
    }
    async with sidecar() as (client, upstream, spool, _m):
        await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    seen = next(s for s in upstream.seen if s.path == "/v1/chat/completions")
    assert seen.headers["authorization"] == "Bearer sekrit-token"
    assert not any(k.startswith("x-reprolane-") for k in seen.headers)
    env = only(spool)
    assert b"sekrit" not in env.canonical()
    assert env.tenant == "acme"
    assert env.workflow is not None
    assert (env.workflow.workflow_id, env.workflow.step) == (
        "claim-7",
        3,
    )
    assert env.flagged
    assert env.flag_reason == "header"


async def test_upstream_cookies_are_never_kept_for_other_clients() -> None:
    """The sidecar's one upstream session serves every client: a cookie upstream sets for one client (say a load
    balancer's sticky session) must reach that client only, never ride along on another client's request."""
    upstream = FakeUpstream(set_cookie="lb=tenant-a-node; Path=/")
    async with serve(upstream.app()) as up_url:
        # A host name, not an IP: cookie jars keep cookies only for names.
        settings = CaptureSettings(upstream=up_url.replace("127.0.0.1", "localhost"), spool_max_bytes=1 << 20)
        app = build_app(settings, spool=FakeSpool(), metrics=CaptureMetrics())
        async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            first = await client.get("/v1/models")
            assert first.headers["set-cookie"] == "lb=tenant-a-node; Path=/"  # the asking client gets it
            client.cookies.clear()
            await client.post("/v1/chat/completions", json=CHAT)
            await client.get("/v1/models", headers={"Cookie": "own=1"})
    chat = next(s for s in upstream.seen if s.path == "/v1/chat/completions")
    assert "cookie" not in chat.headers
    assert upstream.seen[-1].headers["cookie"] == "own=1"  # a client's own cookies still go through, alone


async def test_invalid_reprolane_header_is_400() -> None:
    async with sidecar() as (client, upstream, spool, _m):
        resp = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"X-Reprolane-Step": "x", "X-Reprolane-Workflow-Id": "w"}
        )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "X-Reprolane-Step"
    assert upstream_calls(upstream, "/v1/chat/completions") == []
    assert isinstance(only(spool).outcome, CapturedError)


async def test_tenant_policy_flags() -> None:
    async with sidecar(flag_tenants=("acme",)) as (client, _, spool, _m):
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Reprolane-Tenant": "acme"})
        await client.post("/v1/chat/completions", json=CHAT, headers={"X-Reprolane-Tenant": "other"})
    assert [(e.flagged, e.flag_reason) for e in spool.envelopes] == [(True, "tenant"), (False, None)]


async def test_seed_injection_is_recorded() -> None:
    async with sidecar(inject_seed=True) as (client, upstream, spool, _m):
        await client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7})
        await client.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
    sent = upstream_calls(upstream, "/v1/chat/completions")
    assert isinstance(sent[0]["seed"], int)
    assert "seed" not in sent[1]
    first, greedy = spool.envelopes
    assert first.sampling is not None
    assert first.sampling.seed == sent[0]["seed"]
    assert first.sampling.seed_injected
    assert first.sampling.seed_scope == "per_request"
    assert greedy.sampling is not None
    assert not greedy.sampling.seed_injected
    assert greedy.sampling.seed_scope == "none"


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


async def test_guaranteed_full_spool_answers_503_without_upstream() -> None:
    async with sidecar(FakeSpool(reported_bytes=1 << 20)) as (client, upstream, _spool, _m):
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == 503
    assert upstream_calls(upstream, "/v1/chat/completions") == []


async def test_guaranteed_append_refused_answers_503_never_uncaptured() -> None:
    async with sidecar(FakeSpool(refuse_appends=True)) as (client, _, _s, _m):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as sresp:
            raw = (await sresp.aread()).decode()
    assert resp.status_code == 503
    assert "The capital" not in resp.text
    assert "[DONE]" not in raw
    assert '"code":503' in raw


async def test_best_effort_full_spool_serves_and_counts_drop() -> None:
    async with sidecar(FakeSpool(refuse_appends=True), mode="best_effort") as (client, _, _s, metrics):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200
        for _ in range(100):
            if metrics.value("reprolane_capture_envelopes_dropped_total"):
                break
            await asyncio.sleep(0.01)
    assert metrics.value("reprolane_capture_envelopes_dropped_total") == 1.0


async def test_best_effort_records_after_response_and_shutdown_awaits_it() -> None:
    spool = FakeSpool()
    async with sidecar(spool, mode="best_effort") as (client, _, _s, _m):
        for _ in range(5):
            await client.post("/v1/chat/completions", json=CHAT)
    assert len(spool.envelopes) == 5


async def test_metrics_endpoint_counts_requests() -> None:
    async with sidecar() as (client, _, _s, _m):
        await client.post("/v1/chat/completions", json=CHAT)
        await client.post("/v1/completions", content=b"not json")
        text = (await client.get("/metrics")).text
    assert 'reprolane_capture_requests_total{endpoint="chat.completions",status="200"} 1.0' in text
    assert 'reprolane_capture_requests_total{endpoint="completions",status="400"} 1.0' in text
    assert "reprolane_capture_added_latency_seconds_bucket" in text


async def test_many_bad_requests_leave_no_state_behind() -> None:
    async with sidecar(mode="best_effort") as (client, _, spool, metrics):
        for i in range(200):
            resp = await client.post("/v1/completions", content=b"{" * (i % 7 + 1))
            assert resp.status_code == 400
        await client.get("/metrics")
        proxy_in_flight = metrics.value("reprolane_capture_in_flight")
    assert proxy_in_flight == 0.0
    assert len(spool.envelopes) == 200


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


async def test_a_request_only_the_standard_library_reads_goes_upstream_as_it_came() -> None:
    """msgspec refuses NaN; the standard library reads it, and writes it back the same way for upstream."""
    body = json.dumps({**CHAT, "temperature": math.nan, "messages": [{"role": "user", "content": "h\u00e9"}]})
    async with sidecar() as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", content=body.encode())
    assert resp.status_code == 200
    sent = upstream_calls(upstream, "/v1/chat/completions")[0]
    assert math.isnan(sent["temperature"])
    assert sent["messages"][0]["content"] == "h\u00e9"
    assert only(spool).request_body_sha256 == hashlib.sha256(body.encode()).hexdigest()


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


async def test_a_lone_surrogate_goes_upstream_escaped_as_it_came() -> None:
    """JSON may spell a lone surrogate, UTF-8 cannot: the sidecar crashed with a 500 and recorded nothing."""
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "hi \ud800 there"}]})
    assert "\\ud800" in body
    async with sidecar() as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", content=body.encode())
    assert resp.status_code == 200
    sent = upstream_calls(upstream, "/v1/chat/completions")[0]
    assert sent["messages"][0]["content"] == "hi \ud800 there"
    assert only(spool).request_body_sha256 == hashlib.sha256(body.encode()).hexdigest()


@pytest.mark.parametrize("mode", ["guaranteed", "best_effort"])
async def test_a_failure_of_the_sidecar_is_a_500_and_still_recorded(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr("capture.proxy.prepare", broken)
    async with sidecar(mode=mode) as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        again = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == again.status_code == 500
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "RuntimeError: a bug" in err["message"]
    assert upstream_calls(upstream, "/v1/chat/completions") == []
    assert len(spool.envelopes) == 2
    env = spool.envelopes[0]
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "proxy_error"
    assert env.request_id == resp.headers["x-reprolane-request-id"]


async def test_an_envelope_that_cannot_be_built_is_recorded_as_the_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    from capture import envelope_writer

    real = envelope_writer.build_envelope_bytes

    def fails_with_output(inputs: Any) -> bytes:
        if inputs.collector is not None:
            raise ValueError("a bug")
        return real(inputs)

    monkeypatch.setattr(envelope_writer, "build_envelope_bytes", fails_with_output)
    async with sidecar() as (client, _upstream, spool, _):
        resp = await client.post("/v1/chat/completions", json=CHAT)
    assert resp.status_code == 200  # the client's answer stands
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "proxy_error"
    assert "ValueError" in env.outcome.message
    assert env.model == MODEL
    assert env.request_id == resp.headers["x-reprolane-request-id"]


async def test_a_body_without_content_type_goes_upstream_without_one() -> None:
    """vLLM refuses a body that does not say it is JSON (400); the sidecar used to add the header, so the same
    request succeeded through it."""
    async with sidecar() as (client, upstream, _spool, _):
        await client.post("/v1/chat/completions", content=json.dumps(CHAT).encode())
        await client.post("/tokenize", content=b'{"prompt": "hi"}')
    sent = [s for s in upstream.seen if s.path in ("/v1/chat/completions", "/tokenize")]
    assert [s.path for s in sent] == ["/v1/chat/completions", "/tokenize"]
    assert ["content-type" in s.headers for s in sent] == [False, False]


async def test_a_redirect_is_passed_on_pointing_at_the_sidecar() -> None:
    """Starlette (vLLM's server) answers a trailing slash with a 307 to its own address: followed by the sidecar
    the client got a 200 it would not get directly; followed by the client it generated uncaptured."""
    async with sidecar() as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions/", json=CHAT)
        followed = await client.post(resp.headers["location"], json=CHAT)
    assert resp.status_code == 307
    assert resp.headers["location"] == str(client.base_url.join("/v1/chat/completions"))
    assert len(upstream_calls(upstream, "/v1/chat/completions")) == 1  # the followed request only
    assert followed.status_code == 200
    assert only(spool).request_id == followed.headers["x-reprolane-request-id"]


async def test_sampling_defaults_of_the_model_are_recorded(tmp_path: Any) -> None:
    """A request that leaves temperature, top_k, max_tokens out gets the model's generation_config.json values
    from vLLM (its default --generation-config auto): the envelope records those, not vLLM's own."""
    manifest = tmp_path / "reprolane-manifest.json"
    manifest.write_text(json.dumps({"generation_defaults": {"temperature": 0.6, "top_k": 20, "max_tokens": 64}}))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "seed": 3}
    async with sidecar(manifest_path=manifest) as (client, _u, spool, _):
        await client.post("/v1/chat/completions", json=body)
        await client.post("/v1/chat/completions", json={**body, "temperature": 0.0, "max_tokens": 3})
    model_defaults, explicit = (e.sampling for e in spool.envelopes)
    assert model_defaults is not None
    assert explicit is not None
    assert (model_defaults.temperature, model_defaults.top_k, model_defaults.max_tokens) == (0.6, 20, 64)
    assert model_defaults.seed_scope == "per_request"
    assert (explicit.temperature, explicit.top_k, explicit.max_tokens) == (0.0, 20, 3)
    async with sidecar(manifest_path=manifest, upstream_generation_config="vllm") as (client, _u, spool, _):
        await client.post("/v1/chat/completions", json=body)
    vllm_own = only(spool).sampling
    assert vllm_own is not None
    assert (vllm_own.temperature, vllm_own.top_k, vllm_own.max_tokens) == (1.0, 0, None)


@pytest.mark.parametrize(
    "sse",
    [(b"data: ", b"\r\n\r\n"), (b"data:", b"\n\n"), (b"data:", b"\r\r")],
    ids=["crlf", "no-space", "cr"],
)
async def test_streams_spelled_otherwise_are_relayed_as_spelled_stripped_and_recorded(
    sse: tuple[bytes, bytes],
) -> None:
    """SSE allows CRLF or CR line ends and no space after ``data:`` (sse-starlette, behind many OpenAI-compatible
    servers, writes CRLF): the sidecar looked for LF LF only, so it held the whole stream back and sent none of
    it; and ``data:`` without a space went out unstripped and unrecorded."""
    prefix, end = sse
    async with sidecar(upstream=FakeUpstream(sse=sse)) as (client, _, spool, _m):
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            raw = await resp.aread()
    events = [e for e in raw.split(end) if e]
    assert events[-1] == prefix + b"[DONE]"
    assert all(e.startswith(prefix) for e in events)
    chunks = [json.loads(e[len(prefix) :]) for e in events[:-1]]
    assert len(chunks) == 4
    assert all(c["choices"][0].get("logprobs") is None and c["choices"][0].get("token_ids") is None for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "The capital."
    env = only(spool)
    assert isinstance(env.outcome, CapturedOutput)
    assert list(env.outcome.choices[0].token_ids) == OUTPUT_IDS
    assert env.outcome.choices[0].logprobs is not None


async def test_uncaptured_writes_pass_by_default_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async with sidecar() as (client, upstream, spool, metrics):
        models = await client.get("/v1/models")
        first = await client.post("/tokenize", json={"prompt": "hi"})
        again = await client.post("/tokenize", json={"prompt": "hi"})
    assert (models.status_code, first.status_code, again.status_code) == (200, 200, 200)
    assert [s.path for s in upstream.seen].count("/tokenize") == 2
    assert spool.envelopes == []
    assert metrics.value("reprolane_capture_uncaptured_total", {"kind": "read"}) == 1
    assert metrics.value("reprolane_capture_uncaptured_total", {"kind": "write"}) == 2
    assert caplog.text.count("POST /tokenize passes through uncaptured") == 1


async def test_refuse_uncaptured_answers_403_to_writes_it_cannot_record() -> None:
    """/v1/responses, /v1/messages, /update_weights...: under refuse_uncaptured nothing that could generate, or
    change what upstream serves, reaches it unrecorded; reads and the allowed writes still pass."""
    async with sidecar(refuse_uncaptured=True) as (client, upstream, _spool, metrics):
        refused = await client.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        put = await client.put("/v1/chat/completions", json=CHAT)
        allowed = await client.post("/tokenize", json={"prompt": "hi"})
        read = await client.get("/v1/models")
        captured = await client.post("/v1/chat/completions", json=CHAT)
    assert (refused.status_code, put.status_code) == (403, 403)
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "POST /v1/responses is not captured" in err["message"]
    assert (allowed.status_code, read.status_code, captured.status_code) == (200, 200, 200)
    assert "/v1/responses" not in [s.path for s in upstream.seen]
    assert metrics.value("reprolane_capture_uncaptured_total", {"kind": "refused"}) == 2
