"""The capture endpoints end to end, against a fake vLLM-shaped upstream on real loopback sockets: requests read
and refused, request ids and headers, accounting, the capture modes, the last-resort 500."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from typing import Any

import httpx
import pytest

from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.settings import CaptureSettings
from schemas import CapturedError
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import (
    FakeUpstream,
    serve,
)
from tests.capture.support import CHAT, MODEL, only, sidecar, upstream_calls
from tests.factories import manifest_doc


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


async def test_request_id_rules() -> None:
    """The request id is always the sidecar's own; the client's X-Request-Id is recorded beside it (issue 18)."""
    async with sidecar() as (client, _, spool, _m):
        a = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "order-42"})
        b = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "order-42"})
        c = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "bad id with spaces"})
    ids = [r.headers["x-reprolane-request-id"] for r in (a, b, c)]
    assert all(i.startswith("rl-") and len(i) == 35 for i in ids)
    assert len(set(ids)) == 3
    assert (a.status_code, b.status_code, c.status_code) == (200, 200, 400)
    assert c.json()["error"]["param"] == "X-Request-Id"
    assert [e.request_id for e in spool.envelopes] == ids
    assert [e.client_request_id for e in spool.envelopes] == ["order-42", "order-42", None]


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

    monkeypatch.setattr("capture.request.proxy.prepare", broken)
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
    from capture.request import envelope_writer

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


async def test_sampling_defaults_of_the_model_are_recorded(tmp_path: Any) -> None:
    """A request that leaves temperature, top_k, max_tokens out gets the model's generation_config.json values
    from vLLM (its default --generation-config auto): the envelope records those, not vLLM's own."""
    manifest = tmp_path / "reprolane-manifest.json"
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    manifest.write_text(json.dumps(manifest_doc(generation_defaults=defaults)))
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
