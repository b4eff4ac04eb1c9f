"""``/v1/responses`` and ``/v1/messages`` through the sidecar in front of the real vLLM, with the official ``openai``
(Responses) and ``anthropic`` clients, streamed and not.

The client must see what it sees without the sidecar (a direct call with the same parameters at temperature 0,
ids and timestamps excluded), and the envelope read back from the real spool must hold what upstream computed:
for Responses, upstream's own prompt and output token ids and logprobs (from a direct call that asks for them);
for Messages, whose server returns no token ids, the prompt ids the sidecar computed equal the ones the same
conversation gets from ``/v1/chat/completions`` (so the sidecar renders the messages as vLLM does), and the
re-tokenized answer equals the generated ids of that chat call.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from capture.protocol import messages, responses
from capture.request.app import build_app
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.state import StackInfo
from schemas import CapturedOutput, Envelope, decode_envelope
from tests.capture.fake_upstream import serve
from tests.capture.keys import write_test_keys
from tests.capture.request.test_app_stack import direct

pytestmark = pytest.mark.stack

QUESTION = "What is the capital of France?"
SYSTEM = "You answer in one short sentence."
CUT = 5  # Messages: cut before the answer's own end, whose end-of-sequence token no text holds (`messages.LIMITS`)


def sidecar_settings(stack: StackInfo, tmp_path: Path, keys_path: Path, **more: Any) -> CaptureSettings:
    """Guaranteed mode, API keys, in front of the stack's vLLM (plus `more`: sinks)."""
    assert stack.vllm_url is not None
    assert stack.model_dir is not None
    return CaptureSettings(
        upstream=stack.vllm_url,
        mode="guaranteed",
        spool_dir=tmp_path / "spool",
        manifest_path=stack.model_dir / "reprolane-manifest.json",
        auth_mode="keys",
        api_keys_path=keys_path,
        **more,
    )


def responses_params(stack: StackInfo, **more: Any) -> dict[str, Any]:
    """A greedy Responses request of 8 tokens at most (plus `more`)."""
    return {
        "model": stack.model_name,
        "input": QUESTION,
        "max_output_tokens": 8,
        "temperature": 0,
        "store": False,
        **more,
    }


@contextlib.asynccontextmanager
async def sidecar(stack: StackInfo, tmp_path: Path) -> AsyncIterator[tuple[str, str, Spool]]:
    """The sidecar of `sidecar_settings` without sinks: its URL, a key, its spool."""
    keys = write_test_keys(tmp_path)
    settings = sidecar_settings(stack, tmp_path, keys.path)
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    async with serve(build_app(settings, spool=spool)) as url:
        yield url, keys.bank, spool


async def envelope_of(spool: Spool, request_id: str) -> Envelope:
    """The request's finished envelope (a stream's started record, written first in guaranteed mode, is not)."""
    found = [decode_envelope(e.payload) for e in await spool.pending(10_000)]
    finished = [env for env in found if env.request_id == request_id and not env.is_started_record]
    assert len(finished) == 1, found
    return finished[0]


def seen(response: Any) -> dict[str, Any]:
    """A Responses answer as the client reads it, without what differs call by call (ids, timestamps)."""
    doc: dict[str, Any] = response.model_dump()
    for name in ("id", "created_at"):
        doc.pop(name, None)
    for item in doc.get("output") or ():
        item.pop("id", None)
    return doc


def recorded(env: Envelope) -> tuple[list[int], list[int], str]:
    assert isinstance(env.outcome, CapturedOutput), env.outcome
    assert env.prompt is not None
    assert env.sampling is not None
    choice = env.outcome.choices[0]
    return list(env.prompt.token_ids), list(choice.token_ids), choice.text


async def upstream_ids(stack: StackInfo, params: dict[str, Any]) -> dict[str, Any]:
    """A direct Responses call that asks for token ids and logprobs (what the sidecar asks for)."""
    assert stack.vllm_url is not None
    body = {**params, "enable_response_messages": True, "include": [responses.LOGPROBS_INCLUDE], "top_logprobs": 5}
    async with httpx.AsyncClient(timeout=120) as client:
        resp = await client.post(stack.vllm_url + "/v1/responses", json=body)
    resp.raise_for_status()
    doc: dict[str, Any] = resp.json()
    return doc


def check_responses_envelope(
    env: Envelope, audit: dict[str, Any], text: str, *, k: int, exact: bool, max_tokens: int = 8
) -> None:
    """The envelope against `audit` (a response with token ids and logprobs): its logprobs `exact`ly when the
    client's own answer is `audit`, else closely (the shared stack batches other callers' requests with this
    one's repeat, which moves logprobs in the last digits: STACK.md)."""
    prompt, output, got_text = recorded(env)
    assert env.endpoint == "responses"
    assert prompt == audit["input_messages"][0]["tokens"]
    assert output == audit["output_messages"][0]["tokens"]
    assert got_text == text
    assert env.prompt is not None
    assert env.prompt.source == "upstream"
    assert env.sampling is not None
    assert env.sampling.max_tokens == max_tokens
    assert env.sampling.logprobs == k
    steps = audit["output"][0]["content"][0]["logprobs"]
    assert isinstance(env.outcome, CapturedOutput)
    logprobs = env.outcome.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs) == len(output) == len(steps)
    got = [[s.logprob, *(c.logprob for c in s.top)] for s in logprobs]
    want = [[s["logprob"], *(t["logprob"] for t in s["top_logprobs"])] for s in steps]
    assert got == want if exact else [len(g) for g in got] == [len(w) for w in want]
    if not exact:
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=0.25)
    assert [s.token_id for s in logprobs] == output
    assert [s.token for s in logprobs] == [bytes(s["bytes"]).decode() for s in steps]
    assert env.capture_limits == responses.LIMITS
    assert env.runtime.engine_version == "0.32.0"


async def test_responses_is_transparent_and_recorded(stack: StackInfo, tmp_path: Path) -> None:
    params = responses_params(stack)
    ref = direct(stack)
    async with sidecar(stack, tmp_path) as (url, key, spool):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        raw = await client.responses.with_raw_response.create(**params)
        via = raw.parse()
        plain = await ref.responses.create(**params)
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
        await client.close()
    await ref.close()
    assert seen(via) == seen(plain)  # no token ids, no logprobs, no top_logprobs: what the client gets unasked
    audit = await upstream_ids(stack, params)
    check_responses_envelope(env, audit, plain.output_text, k=5, exact=False)
    assert env.context.stream is False


async def stream_events(client: openai.AsyncOpenAI, params: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """A streamed Responses answer's events (ids and times dropped) and the sidecar's request id header."""
    raw = await client.responses.with_raw_response.create(**params, stream=True)
    out = []
    async for event in raw.parse():
        doc = event.model_dump()
        doc.pop("item_id", None)
        for holder in (doc.get("response"), doc.get("item")):
            if isinstance(holder, dict):
                holder.pop("id", None)
                holder.pop("created_at", None)
                for item in holder.get("output") or ():
                    item.pop("id", None)
        out.append(doc)
    return out, raw.headers.get("x-reprolane-request-id")


def _event_shape(events: list[dict[str, Any]]) -> list[str]:
    """The event types, each run of text deltas as one."""
    shape: list[str] = []
    for e in events:
        if not (e["type"] == "response.output_text.delta" and shape and shape[-1] == e["type"]):
            shape.append(e["type"])
    return shape


def _delta_text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def test_responses_stream_is_transparent_and_recorded(stack: StackInfo, tmp_path: Path) -> None:
    # the client's own logprobs: the envelope holds exactly what it got (cut before the answer's end: see
    # `test_a_streamed_answer_ending_with_a_textless_token_says_why_it_has_no_logprobs`)
    params = responses_params(stack, include=[responses.LOGPROBS_INCLUDE], top_logprobs=2, max_output_tokens=CUT)
    ref = direct(stack)

    async with sidecar(stack, tmp_path) as (url, key, spool):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        via, rid = await stream_events(client, params)
        plain, _ = await stream_events(ref, params)
        completed = (await ref.responses.create(**params, extra_body={"enable_response_messages": True})).model_dump()
        assert rid is not None
        env = await envelope_of(spool, rid)
        await client.close()
    await ref.close()
    # the same events and text; how many tokens one text delta carries is the server's timing, not the sidecar's
    # (vLLM's output loop merges the tokens that arrived since its last send: CI saw 5 deltas through the sidecar
    # and 3 for the direct call, of the same 5 tokens)
    assert _event_shape(via) == _event_shape(plain)
    assert _delta_text(via) == _delta_text(plain)
    assert via[-1]["type"] == "response.completed"
    assert via[-1]["response"]["top_logprobs"] == 2
    assert via[-1]["response"].get("output_messages") is None
    text = _delta_text(via)
    client_saw = via[-1]["response"]
    audit = {
        **client_saw,
        "input_messages": completed["input_messages"],
        "output_messages": completed["output_messages"],
    }
    check_responses_envelope(env, audit, text, k=2, exact=True, max_tokens=CUT)
    assert env.context.stream is True


async def test_a_streamed_answer_ending_with_a_textless_token_says_why_it_has_no_logprobs(
    stack: StackInfo, tmp_path: Path
) -> None:
    """vLLM streams no delta, so no logprob, for the end-of-sequence token: the envelope keeps every token id,
    records no logprobs rather than misaligned ones, and names the limit. Asked for one short sentence: without that
    instruction the greedy answer depends on the CPU's bfloat16 kernels (on one machine it ended in 8 tokens, on
    another it ran past 32)."""
    params = responses_params(
        stack, instructions=SYSTEM, include=[responses.LOGPROBS_INCLUDE], top_logprobs=2, max_output_tokens=32
    )
    async with sidecar(stack, tmp_path) as (url, key, spool):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        via, rid = await stream_events(client, params)
        assert rid is not None
        env = await envelope_of(spool, rid)
        await client.close()
    done = via[-1]["response"]
    assert done["status"] == "completed"  # the answer ended before the 32 tokens
    steps = done["output"][0]["content"][0]["logprobs"]
    _, output, _ = recorded(env)
    assert len(steps) == len(output) - 1  # what vLLM 0.32 streams: the last (textless) token has no step
    assert isinstance(env.outcome, CapturedOutput)
    assert env.outcome.choices[0].logprobs is None
    assert set(responses.TEXTLESS_LAST) <= set(env.capture_limits)


async def chat_reference(stack: StackInfo, max_tokens: int) -> dict[str, Any]:
    """The same conversation through /v1/chat/completions, with its token ids."""
    ref = direct(stack)
    out = await ref.chat.completions.create(
        model=stack.model_name,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    await ref.close()
    doc: dict[str, Any] = out.model_dump()
    return doc


def check_messages_envelope(env: Envelope, chat: dict[str, Any], text: str, input_tokens: int) -> None:
    prompt, output, got_text = recorded(env)
    assert env.endpoint == "messages"
    assert prompt == chat["prompt_token_ids"]  # the sidecar renders the messages as vLLM's conversion does
    assert len(prompt) == input_tokens
    assert env.prompt is not None
    assert env.prompt.source == "tokenize"
    assert got_text == text == chat["choices"][0]["message"]["content"]
    assert output == chat["choices"][0]["token_ids"]  # a cut answer: its text re-tokenizes to the generated ids
    assert isinstance(env.outcome, CapturedOutput)
    assert env.outcome.choices[0].logprobs is None
    assert env.outcome.choices[0].finish_reason == "length"
    assert env.capture_limits == tuple(sorted(messages.LIMITS))
    assert env.sampling is not None
    assert env.sampling.max_tokens == CUT
    assert env.sampling.seed_scope == "none"


async def test_messages_is_recorded_with_the_prompt_vllm_renders(stack: StackInfo, tmp_path: Path) -> None:
    params: dict[str, Any] = {
        "model": stack.model_name,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        "max_tokens": CUT,
        "extra_body": {"temperature": 0},  # anthropic 2.x has no temperature argument; vLLM reads the field
    }
    async with sidecar(stack, tmp_path) as (url, key, spool):
        client = anthropic.AsyncAnthropic(base_url=url, auth_token=key, api_key=None, max_retries=0)
        raw = await client.messages.with_raw_response.create(**params)
        via = await raw.parse()
        assert stack.vllm_url is not None
        ref = anthropic.AsyncAnthropic(base_url=stack.vllm_url, api_key="sk-direct", max_retries=0)
        plain = await ref.messages.create(**params)
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
        await client.close()
        await ref.close()
    assert via.model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})
    text = "".join(b.text for b in via.content if b.type == "text")
    check_messages_envelope(env, await chat_reference(stack, CUT), text, via.usage.input_tokens)


async def test_messages_stream_is_recorded(stack: StackInfo, tmp_path: Path) -> None:
    params: dict[str, Any] = {
        "model": stack.model_name,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": CUT,
        "extra_body": {"temperature": 0},  # anthropic 2.x has no temperature argument; vLLM reads the field
    }
    async with sidecar(stack, tmp_path) as (url, key, spool):
        client = anthropic.AsyncAnthropic(base_url=url, auth_token=key, api_key=None, max_retries=0)
        raw = await client.messages.with_raw_response.create(**params, stream=True)
        kinds, text, input_tokens = [], "", 0
        async for event in await raw.parse():
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
            if event.type == "message_start":
                input_tokens = event.message.usage.input_tokens
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
        await client.close()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    check_messages_envelope(env, await chat_reference(stack, CUT), text, input_tokens)
    assert env.context.stream is True
