"""A tiny OpenAI-shaped upstream in vLLM 0.32's exact response shapes, and helpers to serve ASGI apps on TCP.

Behaviour is chosen by the prompt text (the last message's content, or the completion prompt):
``error400`` -> 400, ``echo400`` -> 400 quoting the request back, ``error500`` -> 500, ``slow`` -> sleeps 5 s
(timeouts, disconnects), ``drip`` -> streams one
chunk every 0.2 s for 50 chunks, ``noids`` -> answers without prompt_token_ids (the /tokenize fallback).
Every request's headers and JSON body are kept in ``seen`` for assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

PROMPT_IDS = [1, 9690, 198, 2683, 314]
OUTPUT_IDS = [504, 3575, 2]
OUTPUT_TEXT = ["The", " capital", "."]
LOGPROBS = [-0.25, -0.5, -0.125]
FINGERPRINT = "vllm-0.32.0-a7512781"
ERROR_400 = {
    "error": {
        "message": "temperature must be non-negative",
        "type": "BadRequestError",
        "param": "temperature",
        "code": 400,
    }
}


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


@dataclass
class FakeUpstream:
    seen: list[Seen] = field(default_factory=list)
    aborted: int = 0
    #: Behave like a hosted API: no /version, a dated model name and version headers on every answer.
    vendor: bool = False
    #: A ``Set-Cookie`` value sent with every ``/v1/models`` answer (a load balancer's sticky-session cookie).
    set_cookie: str | None = None
    #: How each SSE event is spelled: its field prefix and its terminator (vLLM: ``data: `` and LF LF;
    #: sse-starlette, behind many other OpenAI-compatible servers: CRLF CRLF).
    sse: tuple[bytes, bytes] = (b"data: ", b"\n\n")
    #: Serve ``/detokenize`` (absent otherwise, as on a hosted API), each call taking this long; the most calls
    #: in progress at once are kept in ``detokenize_peak``.
    detokenize_delay_s: float | None = None
    detokenize_status: int = 200
    detokenize_in_flight: int = 0
    detokenize_peak: int = 0
    #: Echo the request's X-Request-Id on streamed answers and ``/v1/models``, as vLLM does with
    #: --enable-request-id-headers.
    request_id_headers: bool = False

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/version", self.version),
            Route("/v1/models", self.models),
        ]
        if self.detokenize_delay_s is not None:
            routes.append(Route("/detokenize", self.detokenize, methods=["POST"]))
        return Starlette(routes=routes)

    async def detokenize(self, request: Request) -> Response:
        body = await self._note(request)
        self.detokenize_in_flight += 1
        self.detokenize_peak = max(self.detokenize_peak, self.detokenize_in_flight)
        try:
            await asyncio.sleep(self.detokenize_delay_s or 0.0)
        finally:
            self.detokenize_in_flight -= 1
        if self.detokenize_status != 200:
            return JSONResponse({"error": {"message": "no"}}, status_code=self.detokenize_status)
        return JSONResponse({"prompt": "text of " + ",".join(str(t) for t in body.get("tokens", []))})

    async def _note(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        body = json.loads(raw) if raw else None
        self.seen.append(Seen(request.url.path, dict(request.headers), body))
        return body or {}

    async def version(self, request: Request) -> Response:
        await self._note(request)
        if self.vendor:
            return JSONResponse({"error": "not found"}, status_code=404)
        return JSONResponse({"version": "0.32.0"})

    async def models(self, request: Request) -> Response:
        await self._note(request)
        headers = {"x-upstream": "yes"}
        echoed = self.seen[-1].headers.get("x-request-id") if self.request_id_headers else None
        if echoed:
            headers["x-request-id"] = echoed
        if self.set_cookie:
            headers["set-cookie"] = self.set_cookie
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]}, headers=headers)

    async def tokenize(self, request: Request) -> Response:
        await self._note(request)
        return JSONResponse({"count": len(PROMPT_IDS), "max_model_len": 2048, "tokens": PROMPT_IDS, "token_strs": None})

    async def chat(self, request: Request) -> Response:
        body = await self._note(request)
        messages = body.get("messages") or [{}]
        return await self._answer(body, str(messages[-1].get("content", "")), chat=True)

    async def completions(self, request: Request) -> Response:
        body = await self._note(request)
        return await self._answer(body, str(body.get("prompt", "")), chat=False)

    async def _answer(self, body: dict[str, Any], prompt: str, *, chat: bool) -> Response:
        if "echo400" in prompt:
            return JSONResponse(_echoing_error(body, self.seen[-1].headers), status_code=400)
        if "error400" in prompt:
            return JSONResponse(ERROR_400, status_code=400)
        if "error500" in prompt:
            return JSONResponse(
                {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}},
                status_code=500,
            )
        if "slow" in prompt:
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                self.aborted += 1
                raise
        with_ids = bool(body.get("return_token_ids")) and "noids" not in prompt
        if body.get("stream"):
            echoed = self.seen[-1].headers.get("x-request-id") if self.request_id_headers else None
            return StreamingResponse(
                self._stream(body, with_ids, chat, drip="drip" in prompt),
                media_type="text/event-stream",
                headers={"x-request-id": echoed} if echoed else None,
            )
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(OUTPUT_TEXT), "refusal": None}
        else:
            choice["text"] = "".join(OUTPUT_TEXT)
        choice["logprobs"] = _logprobs(body, range(len(OUTPUT_IDS)), chat)
        choice["finish_reason"] = "stop"
        choice["token_ids"] = OUTPUT_IDS if with_ids else None
        if not chat:
            choice["prompt_token_ids"] = PROMPT_IDS if with_ids else None
        doc: dict[str, Any] = {
            "id": "chatcmpl-1" if chat else "cmpl-1",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": body.get("model"),
            "choices": [choice],
            "system_fingerprint": FINGERPRINT,
            "usage": {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3, "prompt_tokens_details": None},
        }
        if chat:
            doc["prompt_token_ids"] = PROMPT_IDS if with_ids else None
        if self.vendor:
            doc["model"] = f"{body.get('model')}-2026-01-01"
            doc["system_fingerprint"] = "fp_44709d6fcb"
            return JSONResponse(doc, headers={"openai-version": "2020-10-01", "x-unrelated": "no"})
        return JSONResponse(doc)

    def _event(self, obj: dict[str, Any]) -> bytes:
        return self.sse[0] + json.dumps(obj, separators=(",", ":")).encode() + self.sse[1]

    async def _stream(self, body: dict[str, Any], with_ids: bool, chat: bool, *, drip: bool) -> AsyncIterator[bytes]:
        base = {
            "id": "x-1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": body.get("model"),
        }
        try:
            if chat:
                first = {
                    **base,
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "prompt_token_ids": PROMPT_IDS if with_ids else None,
                }
                yield self._event(first)
            steps = range(50) if drip else range(len(OUTPUT_IDS))
            for i in steps:
                j = i % len(OUTPUT_IDS)
                last = i == steps[-1]
                choice: dict[str, Any] = {"index": 0}
                if chat:
                    choice["delta"] = {"content": OUTPUT_TEXT[j]}
                else:
                    choice["text"] = OUTPUT_TEXT[j]
                choice["logprobs"] = _logprobs(body, [j], chat)
                choice["finish_reason"] = "stop" if last else None
                if not chat:
                    choice["prompt_token_ids"] = PROMPT_IDS if with_ids and i == 0 else None
                choice["token_ids"] = [OUTPUT_IDS[j]] if with_ids else None
                chunk: dict[str, Any] = {**base, "choices": [choice]}
                if last:
                    chunk["system_fingerprint"] = FINGERPRINT
                yield self._event(chunk)
                if drip:
                    await asyncio.sleep(0.2)
            yield self.sse[0] + b"[DONE]" + self.sse[1]
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted += 1
            raise


def _echoing_error(body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """A 400 that quotes the request back, as validation errors do: the whole body, the Authorization header,
    and each long string value the way pydantic truncates it (its first 25 and last 24 characters)."""
    quoted = [f"{v[:25]}...{v[-24:]}" for v in _strings(body) if len(v) > 50]
    message = f"1 validation error: input_value={json.dumps(body)}; auth={headers.get('authorization')}; {quoted}"
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _logprobs(body: dict[str, Any], steps: Any, chat: bool) -> dict[str, Any] | None:
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def name(j: int, alt: int = 0) -> str:
        tid = OUTPUT_IDS[j] + alt
        return f"token_id:{tid}" if as_ids else f"tok{tid}"

    if chat:
        if not body.get("logprobs"):
            return None
        k = body.get("top_logprobs") or 0
        content = []
        for j in steps:
            top = [  # like vLLM 0.32: under return_tokens_as_token_ids the alternatives' bytes spell "token_id:N"
                {"token": name(j, a), "logprob": LOGPROBS[j] - a, "bytes": list(name(j, a).encode())} for a in range(k)
            ]
            content.append(
                {"token": name(j), "logprob": LOGPROBS[j], "bytes": list(OUTPUT_TEXT[j].encode()), "top_logprobs": top}
            )
        return {"content": content}
    k = body.get("logprobs")
    if k is None:
        return None
    steps = list(steps)
    return {
        "text_offset": [0 for _ in steps],
        "token_logprobs": [LOGPROBS[j] for j in steps],
        "tokens": [name(j) for j in steps],
        "top_logprobs": [{name(j, a): LOGPROBS[j] - a for a in range(k)} for j in steps],
    }


@contextlib.asynccontextmanager
async def serve(app: Any, *, graceful_s: float | None = None) -> AsyncIterator[str]:
    """Serve an ASGI app on 127.0.0.1 (ephemeral port) in this event loop; yields its base URL. `graceful_s`: how long
    the shutdown waits for requests still running before it cancels them (default: for as long as they run), which a
    fake upstream sleeping through a ``slow`` request the sidecar already gave up on need not have."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="on", access_log=False, timeout_graceful_shutdown=graceful_s
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("server exited before starting")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task
        sock.close()
