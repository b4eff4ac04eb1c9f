"""Shadow traffic (`capture.request.shadow`) in process, on fake upstreams: the deterministic sample, the candidate's
request (same prompt token ids and contract), the paired shadow envelope, and that a slow, blocked or absent
candidate changes nothing of the client's answers (every outcome counted)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from capture.metrics import CaptureMetrics
from capture.publishing.outgoing import Outgoing
from capture.request.shadow import candidate_body, sampled
from capture.spool import SpoolEntry
from infra.stack.ports import allocate_ports
from schemas import CapturedError, CapturedOutput, Envelope, ShadowMarker
from schemas.layout import capture_day, shadow_index_key
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import FINGERPRINT, OUTPUT_IDS, PROMPT_IDS, FakeUpstream, serve
from tests.capture.support import CHAT, sidecar
from tests.replayer.support import make_envelope

REQUESTS = 6


def test_the_sample_is_a_deterministic_share_of_request_ids() -> None:
    ids = [uuid.uuid4().hex for _ in range(20_000)]
    share = sum(sampled(i, 0.25) for i in ids) / len(ids)
    assert 0.23 < share < 0.27
    assert [sampled(i, 0.25) for i in ids[:200]] == [sampled(i, 0.25) for i in ids[:200]]
    assert not any(sampled(i, 0.0) for i in ids[:100])
    assert all(sampled(i, 1.0) for i in ids[:100])
    picked_low = {i for i in ids if sampled(i, 0.1)}
    assert picked_low <= {i for i in ids if sampled(i, 0.3)}  # a larger rate shadows a superset


def test_the_candidate_gets_the_recorded_prompt_ids_and_contract() -> None:
    env = make_envelope(3)
    assert env.sampling is not None
    seeded = env.model_copy(
        update={"sampling": env.sampling.model_copy(update={"seed": 7, "seed_scope": "per_request", "top_k": 0})}
    )
    body = candidate_body(seeded, "cand", 5)
    assert body is not None
    assert body["prompt"] == list(env.prompt.token_ids)  # type: ignore[union-attr]
    assert (body["model"], body["seed"], body["top_k"], body["temperature"]) == ("cand", 7, -1, 0.0)
    assert body["max_tokens"] == env.sampling.max_tokens
    assert body["return_token_ids"] is True
    assert body["logprobs"] == 5
    assert "seed" not in (candidate_body(env, "cand", 5) or {})  # no per-request seed: none sent
    failed = env.model_copy(
        update={"outcome": CapturedError(error_type="timeout", message="x", timings=env.outcome.timings)}
    )
    assert candidate_body(failed, "cand", 5) is None
    assert candidate_body(env.model_copy(update={"prompt": None}), "cand", 5) is None


def _pairs(spool: FakeSpool) -> tuple[list[Envelope], list[Envelope]]:
    prod = [e for e in spool.envelopes if e.shadow is None]
    shadows = [e for e in spool.envelopes if e.shadow is not None]
    return prod, shadows


async def _settled(metrics: CaptureMetrics, total: int, within_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while _counted(metrics) < total:
        assert loop.time() < deadline, f"shadow outcomes: {_outcomes(metrics)}"
        await asyncio.sleep(0.02)


OUTCOMES = ("recorded", "candidate_error", "timeout", "skipped", "dropped_queue", "dropped_spool", "dropped_shutdown")


def _outcomes(metrics: CaptureMetrics) -> dict[str, float]:
    return {o: metrics.value("reprolane_capture_shadow_total", {"outcome": o}) for o in OUTCOMES}


def _counted(metrics: CaptureMetrics) -> float:
    return sum(_outcomes(metrics).values())


@pytest.fixture
async def candidate() -> AsyncIterator[tuple[FakeUpstream, str]]:
    fake = FakeUpstream()
    async with serve(fake.app()) as url:
        yield fake, url


async def _answers(client: httpx.AsyncClient, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        resp = await client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200, resp.text
        doc = resp.json()
        out.append(doc)
    return out


async def test_every_sampled_request_gets_a_paired_shadow_envelope(candidate: tuple[FakeUpstream, str]) -> None:
    fake, url = candidate
    async with sidecar(mode="guaranteed") as (client, _, plain_spool, _):
        plain = await _answers(client, REQUESTS)
    async with sidecar(mode="guaranteed", shadow_upstream=url, shadow_sample=1.0, shadow_model="cand") as (
        client, _, spool, metrics,
    ):  # fmt: skip
        shadowed = await _answers(client, REQUESTS)
        await _settled(metrics, REQUESTS)
    assert shadowed == plain  # the client's answers are the same with shadowing on
    assert _outcomes(metrics)["recorded"] == REQUESTS
    prod, shadows = _pairs(spool)
    assert len(prod) == len(shadows) == REQUESTS
    by_id = {e.request_id: e for e in prod}
    for shadow in shadows:
        original = by_id[shadow.request_id]
        assert shadow.shadow is not None
        assert shadow.shadow.production_envelope_id == original.envelope_id()
        assert shadow.shadow.candidate == url
        assert shadow.prompt == original.prompt
        assert shadow.sampling == original.sampling
        assert shadow.runtime.system_fingerprint == FINGERPRINT
        assert not shadow.flagged
        assert isinstance(shadow.outcome, CapturedOutput)
        assert shadow.outcome.choices[0].token_ids == tuple(OUTPUT_IDS)
    calls = [s.body for s in fake.seen if s.path == "/v1/completions"]
    assert len(calls) == REQUESTS
    assert all(c is not None and c["prompt"] == PROMPT_IDS and c["model"] == "cand" for c in calls)
    assert len(plain_spool.envelopes) == REQUESTS


async def test_a_blocked_candidate_delays_nothing_and_overflow_is_counted() -> None:
    release = asyncio.Event()

    async def hang(request: Request) -> Response:
        await release.wait()
        return Response(b"{}", media_type="application/json")

    async def version(request: Request) -> Response:
        return Response(b'{"version": "0.33.0"}', media_type="application/json")

    app = Starlette(routes=[Route("/v1/completions", hang, methods=["POST"]), Route("/version", version)])
    async with serve(app) as url:
        settings = {"shadow_upstream": url, "shadow_sample": 1.0, "shadow_queue": 2, "shadow_concurrency": 1}
        async with sidecar(mode="guaranteed", **settings) as (client, _, spool, metrics):
            # every answer arrives while the candidate holds its one shadow request forever
            await asyncio.wait_for(_answers(client, REQUESTS), 30)
            prod, shadows = _pairs(spool)
            assert (len(prod), len(shadows)) == (REQUESTS, 0)
            assert _outcomes(metrics)["dropped_queue"] == REQUESTS - 3  # one in flight, two queued
        release.set()
    # shutdown: the one in flight and the two queued were given up, counted
    assert _outcomes(metrics)["dropped_shutdown"] == 3


async def test_an_absent_candidate_is_counted_and_recorded_as_errors() -> None:
    (port,) = allocate_ports(1)  # nothing listens there
    async with sidecar(mode="best_effort", shadow_upstream=f"http://127.0.0.1:{port}", shadow_sample=1.0) as (
        client, _, spool, metrics,
    ):  # fmt: skip
        await _answers(client, 3)
        await _settled(metrics, 3)
    assert _outcomes(metrics)["candidate_error"] == 3
    prod, shadows = _pairs(spool)
    assert len(prod) == 3
    assert all(isinstance(s.outcome, CapturedError) and s.outcome.error_type == "upstream_error" for s in shadows)


async def test_shadows_never_fill_the_spool_production_needs(candidate: tuple[FakeUpstream, str]) -> None:
    _, url = candidate
    full = FakeSpool(reported_bytes=600 << 10)  # above half of the sidecar's 1 MiB bound, below the bound
    async with sidecar(full, shadow_upstream=url, shadow_sample=1.0) as (client, _, spool, metrics):
        await _answers(client, 2)
        await _settled(metrics, 2)
    assert _outcomes(metrics)["dropped_spool"] == 2
    assert _pairs(spool) == (spool.envelopes, [])


def test_a_shadow_takes_only_its_own_index_entry() -> None:
    env = make_envelope(1, workflow="wf-1")
    shadow = env.model_copy(update={"shadow": ShadowMarker(
        production_envelope_id="a" * 64, candidate="http://c")})  # fmt: skip
    out = Outgoing.from_entry(SpoolEntry(seq=1, payload=shadow.canonical()))
    assert out.shadow
    assert out.index_keys() == [shadow_index_key(capture_day(shadow.captured_at), shadow.request_id)]
    prod = Outgoing.from_entry(SpoolEntry(seq=2, payload=env.canonical()))
    assert not prod.shadow
    assert shadow_index_key(capture_day(env.captured_at), env.request_id) not in prod.index_keys()
