"""The sidecar's edge against a hostile client, on the real CLI sidecar (``reprolane serve capture`` in a
subprocess) in front of the fake upstream: targets that would make it an open proxy (under both of uvicorn's
parsers), half-sent requests, bodies that would crash the parser, and what reaches the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from capture.request.edge import MAX_REQUEST_DEPTH
from capture.request.http_server import Parser
from capture.spool import Spool
from schemas import CapturedError, CapturedOutput, Envelope, decode_envelope
from tests.capture.fake_upstream import FakeUpstream, serve
from tests.capture.request.cli_sidecar import (
    HOST,
    Bystander,
    RunningSidecar,
    bystander,
    cli_sidecar,
    exchange,
    parse_response,
)

PARSERS: tuple[Parser, ...] = ("h11", "httptools")


@contextlib.asynccontextmanager
async def real_sidecar(tmp_path: Path, **env: str) -> AsyncIterator[tuple[RunningSidecar, FakeUpstream]]:
    upstream = FakeUpstream()
    async with serve(upstream.app(), graceful_s=0.5) as up_url, cli_sidecar(up_url, tmp_path, **env) as sidecar:
        yield sidecar, upstream


def hostile_targets(port: int) -> list[str]:
    """Request targets that name another host, or climb out of a path, in the spellings parsers let through."""
    return [
        f"%2F@{HOST}:{port}/x",  # h11: base URL + target = http://upstream%2F@127.0.0.1:PORT/x
        f"@{HOST}:{port}/x",
        f"//{HOST}:{port}/x",
        f"http://{HOST}:{port}/x",  # absolute form
        f"/%2F{HOST}:{port}/x",
        "/..%2F..",
        "/../../x",
        "/%2e%2e/x",
        f"/\\{HOST}:{port}/x",
        f"/\\\\{HOST}:{port}/x",
        f"\\\\{HOST}:{port}/x",
        "/x%zz",
    ]


@pytest.mark.parametrize("parser", PARSERS)
async def test_no_target_reaches_another_host(tmp_path: Path, parser: Parser) -> None:
    async with bystander() as other, real_sidecar(tmp_path, http_parser=parser) as (sidecar, upstream):
        answers: dict[tuple[str, str], tuple[int, dict[str, str], bytes]] = {}
        for target in hostile_targets(other.port):
            for method in ("GET", "POST"):
                request = f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
                answers[method, target] = await exchange(sidecar.port, request.encode("latin-1"))
        normal = await exchange(sidecar.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert_untouched(other, answers)
    for (method, target), (status, _, body) in answers.items():
        if parser == "httptools" and target.startswith("http://"):
            # httptools hands the app only the absolute form's path: "/x", on upstream's own host
            assert status == 404, (method, target, status, body)
            continue
        assert status == 400, (method, target, status, body)
        if body.startswith(b"{"):  # refused by the sidecar (httptools refuses some before the app sees them)
            assert json.loads(body)["error"]["type"] == "invalid_request_error", (method, target, body)
        else:
            assert parser == "httptools", (method, target, body)
    assert [s.path for s in upstream.seen if s.path not in ("/version", "/v1/models")] in ([], ["/x", "/x"])
    assert normal[0] == 200  # and an ordinary pass-through still works


def assert_untouched(other: Bystander, answers: dict[Any, tuple[int, dict[str, str], bytes]]) -> None:
    assert other.connections == 0, f"the sidecar connected to another host: {other.received}"
    leaked = [key for key, (_, _, body) in answers.items() if b"BYSTANDR" in body]
    assert leaked == []


@pytest.mark.parametrize("parser", PARSERS)
async def test_the_pinned_parser_is_the_one_serving(tmp_path: Path, parser: Parser) -> None:
    """h11 and httptools answer a target without a leading '/' differently: the sidecar (the app, 400 in
    OpenAI's format) under h11, the parser itself (plain text) under httptools; the CLI's pin decides which."""
    async with real_sidecar(tmp_path, http_parser=parser) as (sidecar, _):
        status, _, body = await exchange(sidecar.port, b"GET %2F@x/y HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 400
    assert body.startswith(b"{") == (parser == "h11"), body


BOUNDS = {"request_head_timeout_s": "1", "request_body_timeout_s": "1"}
CHAT_HEAD = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


async def closed_within(reader: asyncio.StreamReader, within_s: float) -> bytes:
    """What the sidecar sent before it closed the connection (fails if it still holds it after `within_s`)."""
    try:
        return await asyncio.wait_for(reader.read(), within_s)
    except TimeoutError:
        raise AssertionError(f"the sidecar still holds the connection after {within_s} s") from None


async def chat_request(port: int) -> int:
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]})
    request = f"{CHAT_HEAD}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
    status, _, _ = await exchange(port, request.encode())
    return status


@pytest.mark.parametrize("parser", PARSERS)
async def test_half_sent_heads_are_dropped_and_the_sidecar_still_answers(tmp_path: Path, parser: Parser) -> None:
    async with real_sidecar(tmp_path, **BOUNDS, http_parser=parser) as (sidecar, _):
        held = [await asyncio.open_connection(HOST, sidecar.port) for _ in range(50)]
        for i, (_, writer) in enumerate(held):
            if i % 5:  # one in five sends nothing at all
                writer.write(CHAT_HEAD.encode()[: 10 + i])
        answers = await asyncio.gather(*(closed_within(reader, 5.0) for reader, _ in held))
        assert answers == [b""] * 50  # closed without an answer: there was no request to answer
        for _, writer in held:
            writer.close()
        assert await chat_request(sidecar.port) == 200


@pytest.mark.parametrize("parser", PARSERS)
async def test_half_a_head_after_an_answer_on_a_kept_alive_connection_is_dropped(
    tmp_path: Path, parser: Parser
) -> None:
    """Sending part of the next head cancels uvicorn's keep-alive timer; the head deadline still runs."""
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]})
    async with real_sidecar(tmp_path, **BOUNDS, http_parser=parser) as (sidecar, _):
        reader, writer = await asyncio.open_connection(HOST, sidecar.port)
        writer.write(f"{CHAT_HEAD}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(parse_response(head)[1]["content-length"])
        await reader.readexactly(length)
        assert head.startswith(b"HTTP/1.1 200")
        writer.write(CHAT_HEAD.encode()[:20])
        assert await closed_within(reader, 4.0) == b""
        writer.close()


async def test_a_body_that_does_not_arrive_is_a_408_in_openai_format(tmp_path: Path) -> None:
    async with real_sidecar(tmp_path, **BOUNDS) as (sidecar, upstream):
        held = [await asyncio.open_connection(HOST, sidecar.port) for _ in range(10)]
        for _, writer in held:
            writer.write(f'{CHAT_HEAD}Content-Length: 100\r\n\r\n{{"model":'.encode())
        answers = await asyncio.gather(*(closed_within(reader, 5.0) for reader, _ in held))
        for _, writer in held:
            writer.close()
        assert await chat_request(sidecar.port) == 200
    for raw in answers:
        status, headers, body = parse_response(raw)
        assert status == 408
        assert headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert [s.path for s in upstream.seen].count("/v1/chat/completions") == 1  # only the complete one
    refused = [e.outcome for e in await spooled(sidecar.spool_dir) if isinstance(e.outcome, CapturedError)]
    assert [(o.error_type, o.status_code) for o in refused] == [("bad_request", 408)] * len(answers)


async def test_requests_beyond_the_concurrency_bound_get_503(tmp_path: Path) -> None:
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "slow"}]})
    slow = f"{CHAT_HEAD}Content-Length: {len(body)}\r\n\r\n{body}".encode()
    async with real_sidecar(tmp_path, max_concurrency="2") as (sidecar, _):
        held = [await asyncio.open_connection(HOST, sidecar.port) for _ in range(2)]
        for _, writer in held:
            writer.write(slow)  # upstream takes 5 s over these
        await asyncio.sleep(0.5)
        status, _, refused = await exchange(sidecar.port, slow + b"")
        assert status == 503
        assert json.loads(refused)["error"]["type"] == "service_unavailable"  # OpenAI's format, not uvicorn's text
        for _, writer in held:
            writer.close()  # the client hangs up: the sidecar cancels upstream and frees the slots
        for _ in range(50):
            status = await chat_request(sidecar.port)
            if status != 503:
                break
            await asyncio.sleep(0.1)
        assert status == 200


async def spooled(spool_dir: Path) -> list[Envelope]:
    """The envelopes a stopped sidecar left in its spool."""
    spool = Spool(spool_dir, max_bytes=1 << 30)
    await spool.open()
    try:
        return [decode_envelope(entry.payload) for entry in await spool.pending(10_000)]
    finally:
        await spool.close()


def chat_with(extra: str) -> bytes:
    """A chat request with `extra` (raw JSON) as the value of an extra field."""
    return b'{"model":"fake-model","messages":[{"role":"user","content":"Hi"}],"x":' + extra.encode() + b"}"


@pytest.mark.parametrize("depth", [1000, 129])
async def test_a_deeply_nested_body_is_a_400_recorded_as_a_bad_request(tmp_path: Path, depth: int) -> None:
    bodies = ["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth]
    async with real_sidecar(tmp_path) as (sidecar, upstream):
        answers = []
        for body in [*bodies, *(chat_with(b).decode() for b in bodies)]:
            request = f"{CHAT_HEAD}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}"
            answers.append(await exchange(sidecar.port, request.encode()))
        assert await chat_request(sidecar.port) == 200
    assert "Traceback" not in sidecar.log_text()
    for status, _, body in answers:
        assert status == 400, body
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error"
        assert "nested" in error["message"]
    assert [s.path for s in upstream.seen].count("/v1/chat/completions") == 1
    refused = [e.outcome for e in await spooled(sidecar.spool_dir) if isinstance(e.outcome, CapturedError)]
    assert [(o.error_type, o.status_code) for o in refused] == [("bad_request", 400)] * len(answers)


async def test_nesting_within_the_bound_is_served_and_recorded(tmp_path: Path) -> None:
    deep = '{"a":' * (MAX_REQUEST_DEPTH - 1) + "1" + "}" * (MAX_REQUEST_DEPTH - 1)
    async with real_sidecar(tmp_path) as (sidecar, _):
        body = chat_with(deep)
        request = f"{CHAT_HEAD}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        status, _, _ = await exchange(sidecar.port, request)
    assert status == 200
    (env,) = await spooled(sidecar.spool_dir)
    assert isinstance(env.outcome, CapturedOutput)
    assert env.sampling is not None
    assert env.sampling.extra["x"].count("{") == MAX_REQUEST_DEPTH - 1
