"""Paths the sidecar does not capture: forwarded as they are, counted, logged once, or refused."""

from __future__ import annotations

import pytest

from tests.capture.fake_upstream import FakeUpstream
from tests.capture.support import CHAT, MODEL, only, sidecar, upstream_calls


async def test_other_paths_pass_through_without_envelope() -> None:
    async with sidecar() as (client, _upstream, spool, _):
        resp = await client.get("/v1/models?x=1")
        version = await client.get("/version")
    assert resp.status_code == 200
    assert resp.json()["data"][0]["id"] == "fake-model"
    assert resp.headers["x-upstream"] == "yes"
    assert version.json() == {"version": "0.32.0"}
    assert spool.envelopes == []


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
    """/inference/v1/generate, /update_weights...: under refuse_uncaptured nothing that could generate, or
    change what upstream serves, reaches it unrecorded; reads and the allowed writes still pass."""
    async with sidecar(refuse_uncaptured=True) as (client, upstream, _spool, metrics):
        refused = await client.post("/inference/v1/generate", json={"model": MODEL, "token_ids": [1, 2]})
        put = await client.put("/v1/chat/completions", json=CHAT)
        allowed = await client.post("/tokenize", json={"prompt": "hi"})
        read = await client.get("/v1/models")
        captured = await client.post("/v1/chat/completions", json=CHAT)
    assert (refused.status_code, put.status_code) == (403, 403)
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "POST /inference/v1/generate is not captured" in err["message"]
    assert (allowed.status_code, read.status_code, captured.status_code) == (200, 200, 200)
    assert "/inference/v1/generate" not in [s.path for s in upstream.seen]
    assert metrics.value("reprolane_capture_uncaptured_total", {"kind": "refused"}) == 2


async def test_upstream_gets_the_sidecars_request_id_never_the_clients() -> None:
    """docs/SECURITY.md: a client's X-Request-Id never reaches upstream, on a pass-through path either: vLLM names
    an engine request after it (``/inference/v1/generate``), and a client could name one after another request.
    Each request gets an id of the sidecar's own; an upstream that echoes it gives the client its own back."""
    upstream = FakeUpstream(request_id_headers=True)
    async with sidecar(upstream=upstream) as (client, _, spool, _m):
        mine = {"X-Request-Id": "rl-chosen-by-the-client"}
        read = await client.get("/v1/models", headers=mine)
        write = await client.post("/tokenize", json={"prompt": "hi"}, headers=mine)
        bare = await client.get("/v1/models")
    assert (read.status_code, write.status_code, bare.status_code) == (200, 200, 200)
    seen = [s.headers.get("x-request-id") for s in upstream.seen if s.path in ("/v1/models", "/tokenize")]
    assert len(seen) == 3
    assert all(rid is not None and rid.startswith("rl-") and len(rid) == 35 for rid in seen), seen
    assert len(set(seen)) == 3  # a fresh one each time, not the client's
    assert read.headers["x-request-id"] == "rl-chosen-by-the-client"  # the echo, given back as the client sent it
    assert bare.headers["x-request-id"] == seen[2]  # nothing to give back: the id upstream got
    assert spool.envelopes == []
