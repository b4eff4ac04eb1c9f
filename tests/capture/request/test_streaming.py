"""A captured request answered as a stream: events stripped and recorded one by one, spelled as upstream did."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas import CapturedError, CapturedOutput
from tests.capture.fake_upstream import (
    FINGERPRINT,
    OUTPUT_IDS,
    PROMPT_IDS,
    FakeUpstream,
)
from tests.capture.support import CHAT, MODEL, finished, sidecar


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
    env = finished(spool)
    assert env.request_id == rid
    assert env.context.stream is True
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == PROMPT_IDS
    assert isinstance(env.outcome, CapturedOutput)
    assert list(env.outcome.choices[0].token_ids) == OUTPUT_IDS
    assert env.outcome.choices[0].finish_reason == "stop"
    assert env.outcome.timings.first_token_ms is not None
    assert env.outcome.timings.upstream_ms >= env.outcome.timings.first_token_ms  # to the stream's end
    assert env.runtime.system_fingerprint == FINGERPRINT


async def test_completions_stream_with_client_logprobs() -> None:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "stream": True, "logprobs": 1}
    async with sidecar() as (client, _, spool, _m):
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            raw = (await resp.aread()).decode()
    chunks = [json.loads(e[len("data: ") :]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert all(c["choices"][0]["token_ids"] is None and c["choices"][0]["prompt_token_ids"] is None for c in chunks)
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["tok504"]
    env = finished(spool)
    assert env.endpoint == "completions"
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == PROMPT_IDS
    assert isinstance(env.outcome, CapturedOutput)
    steps = env.outcome.choices[0].logprobs
    assert steps is not None
    assert [s.token_id for s in steps] == OUTPUT_IDS
    assert steps[2].logprob == -0.125


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
        await spool.wait_for(2)
        for _ in range(50):
            if upstream.aborted:
                break
            await asyncio.sleep(0.05)
    env = finished(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.outcome.error_type == "client_disconnect"
    assert env.outcome.partial
    assert len(env.outcome.partial[0].token_ids) >= 2
    assert env.outcome.timings.upstream_ms >= 150.0  # events 0.2 s apart: timed up to the hang-up, not one event
    assert upstream.aborted >= 1


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
    env = finished(spool)
    assert isinstance(env.outcome, CapturedOutput)
    assert list(env.outcome.choices[0].token_ids) == OUTPUT_IDS
    assert env.outcome.choices[0].logprobs is not None
