"""The sidecar's half of the schedule join (issue 22): upstream gets the sidecar's own request id as
``X-Request-Id`` (never the client's), and with ``schedule_recorder`` set each envelope names the engine request
vLLM makes of it (`schemas.schedule_delivery.external_request_id_for`)."""

from __future__ import annotations

import asyncio

from tests.capture.fake_upstream import FakeUpstream, Seen
from tests.capture.support import CHAT, MODEL, finished, only, sidecar


def _forwarded_ids(seen: list[Seen], path: str) -> list[str]:
    """The X-Request-Id upstream received on each call to `path`."""
    return [s.headers.get("x-request-id", "") for s in seen if s.path == path]


async def test_upstream_gets_the_sidecar_request_id_not_the_clients() -> None:
    async with sidecar(schedule_recorder="vllm-scheduler") as (client, upstream, spool, _):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "order-42"})
    env = only(spool)
    assert resp.status_code == 200
    assert _forwarded_ids(upstream.seen, "/v1/chat/completions") == [env.request_id]
    assert env.client_request_id == "order-42"
    assert env.schedule is not None
    assert env.schedule.external_request_id == f"chatcmpl-{env.request_id}"
    assert env.schedule.recorder == "vllm-scheduler"


async def test_completions_and_streams_name_their_engine_request() -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    async with sidecar(schedule_recorder="vllm-scheduler") as (client, upstream, spool, _):
        await client.post("/v1/completions", json=body)
    env = only(spool)
    assert env.schedule is not None
    assert env.schedule.external_request_id == f"cmpl-{env.request_id}-0"
    assert _forwarded_ids(upstream.seen, "/v1/completions") == [env.request_id]

    async with sidecar(schedule_recorder="vllm-scheduler") as (client, upstream, spool, _):
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            await resp.aread()
    done = finished(spool)
    assert done.schedule is not None
    assert done.schedule.external_request_id == f"chatcmpl-{done.request_id}"
    assert _forwarded_ids(upstream.seen, "/v1/chat/completions") == [done.request_id]


async def test_no_schedule_ref_unless_upstream_records() -> None:
    async with sidecar() as (client, upstream, spool, _):
        await client.post("/v1/chat/completions", json=CHAT)
    env = only(spool)
    assert env.schedule is None
    assert _forwarded_ids(upstream.seen, "/v1/chat/completions") == [env.request_id]  # forwarded either way


async def test_refused_attempts_never_went_upstream_and_name_no_schedule() -> None:
    async with sidecar(schedule_recorder="vllm-scheduler") as (client, _upstream, spool, _):
        resp = await client.post(
            "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert resp.status_code == 400
    assert only(spool).schedule is None


async def test_concurrent_requests_with_swapped_client_ids_each_forward_their_own_id() -> None:
    """Two clients that send each other's X-Request-Id at once: upstream's ids (and so the engine requests the
    schedule log names) follow the sidecar's request ids, one to one."""
    async with sidecar(schedule_recorder="vllm-scheduler") as (client, upstream, spool, _):
        a, b = await asyncio.gather(
            client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "b"}),
            client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "a"}),
        )
    by_id = {e.request_id: e for e in spool.envelopes}
    assert set(by_id) == {a.headers["x-reprolane-request-id"], b.headers["x-reprolane-request-id"]}
    assert sorted(_forwarded_ids(upstream.seen, "/v1/chat/completions")) == sorted(by_id)
    for rid, env in by_id.items():
        assert env.schedule is not None
        assert env.schedule.external_request_id == f"chatcmpl-{rid}"
    assert {e.client_request_id for e in by_id.values()} == {"a", "b"}


async def test_an_upstream_that_echoes_x_request_id_gives_the_client_its_own_back() -> None:
    """vLLM with --enable-request-id-headers echoes the X-Request-Id it got (the sidecar's): the client sees its
    own value, as if it had talked to upstream directly."""
    upstream = FakeUpstream(request_id_headers=True)
    async with sidecar(upstream=upstream) as (client, _, spool, _m):
        body = {**CHAT, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Request-Id": "mine"}) as r:
            await r.aread()
            mine = r.headers.get("x-request-id")
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            await r.aread()
            none_sent = r.headers.get("x-request-id")
    assert mine == "mine"
    forwarded = _forwarded_ids(upstream.seen, "/v1/chat/completions")
    assert forwarded == list(dict.fromkeys(e.request_id for e in spool.envelopes))  # upstream got the sidecar's
    assert none_sent == r.headers["x-reprolane-request-id"]  # no id of the client's to restore: the sidecar's
