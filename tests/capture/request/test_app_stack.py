"""The sidecar in front of the real vLLM, driven by the official ``openai`` client.

The client must see exactly what it sees without the sidecar (a direct call with the same parameters at
temperature 0, ``id`` and ``created`` excluded), and the envelope read back from the real spool must hold
upstream's own token ids and logprobs (taken from a direct call that asks for them).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from capture.request.app import build_app
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.state import StackInfo
from schemas import CapturedOutput, Envelope, decode_envelope
from tests.capture.fake_upstream import serve
from tests.capture.keys import write_test_keys

pytestmark = pytest.mark.stack

VOLATILE = {"id", "created"}
MESSAGES: Any = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@contextlib.asynccontextmanager
async def through_sidecar(stack: StackInfo, tmp_path: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, Spool]]:
    assert stack.vllm_url is not None
    assert stack.model_dir is not None
    keys = write_test_keys(tmp_path)
    settings = CaptureSettings(
        upstream=stack.vllm_url,
        mode="guaranteed",
        spool_dir=tmp_path / "spool",
        manifest_path=stack.model_dir / "reprolane-manifest.json",
        auth_mode="keys",
        api_keys_path=keys.path,
    )
    spool = Spool(settings.spool_dir, max_bytes=settings.spool_max_bytes)
    async with serve(build_app(settings, spool=spool)) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=keys.bank, max_retries=0)
        try:
            yield client, spool
        finally:
            await client.close()


def direct(stack: StackInfo) -> openai.AsyncOpenAI:
    assert stack.vllm_url is not None
    return openai.AsyncOpenAI(base_url=stack.vllm_url + "/v1", api_key="sk-direct", max_retries=0)


def visible(obj: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = obj.model_dump()
    return {k: v for k, v in dumped.items() if k not in VOLATILE}


def as_said(chunks: list[dict[str, Any]]) -> tuple[str, dict[int, str | None], set[str]]:
    """A stream as what it says: its text, each choice's finish reason, and every field path its chunks use. vLLM
    sends a chunk per token, or several tokens in one when its output loop falls behind (its output collector merges
    what the stream has not taken yet, on a loaded machine), so two streams of one greedy request may be cut
    differently; they never say different things."""
    text: list[str] = []
    finished: dict[int, str | None] = {}
    paths: set[str] = set()

    def walk(value: Any, path: str) -> None:
        paths.add(path)
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, list):
            for item in value:
                walk(item, f"{path}[]")

    for chunk in chunks:
        walk(chunk, "")
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            finished[choice["index"]] = choice.get("finish_reason") or finished.get(choice["index"])
    return "".join(text), finished, paths


async def envelope_of(spool: Spool, request_id: str) -> Envelope:
    for entry in await spool.pending(10_000):
        env = decode_envelope(entry.payload)
        if env.request_id == request_id:
            return env
    raise AssertionError(f"no envelope for {request_id}")


async def test_chat_is_transparent_and_recorded_exactly(stack: StackInfo, tmp_path: Path) -> None:
    params: dict[str, Any] = {"model": stack.model_name, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    ref_client = direct(stack)
    async with through_sidecar(stack, tmp_path) as (client, spool):
        raw = await client.chat.completions.with_raw_response.create(**params)
        via = raw.parse()
        plain = await ref_client.chat.completions.create(**params)
        audit = await ref_client.chat.completions.create(
            **params,
            logprobs=True,
            top_logprobs=5,
            extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
        )
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
    await ref_client.close()
    assert visible(via) == visible(plain)
    audit_doc = audit.model_dump()
    assert isinstance(env.outcome, CapturedOutput)
    choice = env.outcome.choices[0]
    assert list(choice.token_ids) == audit_doc["choices"][0]["token_ids"]
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == audit_doc["prompt_token_ids"]
    assert choice.text == plain.choices[0].message.content
    steps = audit_doc["choices"][0]["logprobs"]["content"]
    assert choice.logprobs is not None
    assert len(choice.logprobs) == len(steps)
    for got, want in zip(choice.logprobs, steps, strict=True):
        assert got.logprob == want["logprob"]
        assert [c.token_id for c in got.top] == [int(t["token"].split(":")[1]) for t in want["top_logprobs"]]
        assert [c.logprob for c in got.top] == [t["logprob"] for t in want["top_logprobs"]]
    assert env.runtime.engine == "vllm"
    assert env.runtime.engine_version == "0.32.0"
    assert env.runtime.system_fingerprint == plain.system_fingerprint
    assert env.artifacts.model_sha256 is not None
    assert env.sampling is not None
    assert env.sampling.seed_scope == "none"


async def test_chat_with_client_logprobs_is_transparent(stack: StackInfo, tmp_path: Path) -> None:
    params: dict[str, Any] = {
        "model": stack.model_name,
        "messages": MESSAGES,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    ref_client = direct(stack)
    async with through_sidecar(stack, tmp_path) as (client, _):
        via = await client.chat.completions.create(**params)
        plain = await ref_client.chat.completions.create(**params)
    await ref_client.close()
    assert visible(via) == visible(plain)


async def test_completions_is_transparent_and_recorded(stack: StackInfo, tmp_path: Path) -> None:
    params: dict[str, Any] = {"model": stack.model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    ref_client = direct(stack)
    async with through_sidecar(stack, tmp_path) as (client, spool):
        raw = await client.completions.with_raw_response.create(**params)
        via = raw.parse()
        plain = await ref_client.completions.create(**params)
        audit = await ref_client.completions.create(
            **params, logprobs=5, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True}
        )
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
    await ref_client.close()
    assert visible(via) == visible(plain)
    want = audit.model_dump()["choices"][0]
    assert isinstance(env.outcome, CapturedOutput)
    choice = env.outcome.choices[0]
    assert list(choice.token_ids) == want["token_ids"]
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == want["prompt_token_ids"]
    assert choice.logprobs is not None
    assert [s.logprob for s in choice.logprobs] == want["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_streaming_is_transparent_and_recorded(stack: StackInfo, tmp_path: Path, endpoint: str) -> None:
    ref_client = direct(stack)

    async def chunks(client: openai.AsyncOpenAI) -> list[dict[str, Any]]:
        if endpoint == "chat":
            stream: Any = await client.chat.completions.create(
                model=stack.model_name, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
            )
        else:
            stream = await client.completions.create(
                model=stack.model_name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
            )
        return [visible(c) async for c in stream]

    async with through_sidecar(stack, tmp_path) as (client, spool):
        via = await chunks(client)
        plain = await chunks(ref_client)
        started, entry = await spool.pending(10)  # guaranteed: the started record, then the finished envelope
        assert decode_envelope(started.payload).is_started_record
        env = decode_envelope(entry.payload)
    await ref_client.close()
    assert as_said(via) == as_said(plain)
    assert isinstance(env.outcome, CapturedOutput)
    assert env.context.stream
    if endpoint == "chat":
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in plain if c["choices"])
    else:
        text = "".join(c["choices"][0]["text"] for c in plain if c["choices"])
    assert env.outcome.choices[0].text == text
    assert env.outcome.choices[0].logprobs is not None
    assert len(env.outcome.choices[0].logprobs) == len(env.outcome.choices[0].token_ids) > 0


@pytest.mark.parametrize(
    ("prompt", "stream"),
    [(PROMPT, False), (PROMPT, True), ([504, 3575, 282], False)],
    ids=["text", "text-stream", "token-ids"],
)
async def test_completions_echo_is_transparent_and_recorded(
    stack: StackInfo, tmp_path: Path, prompt: Any, stream: bool
) -> None:
    """vLLM leaves the prompt's text out of an echoed answer when token ids are asked for: the sidecar asks
    for them anyway and puts the text back, so the client reads what vLLM answers to its own request."""
    params: dict[str, Any] = {"model": stack.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    ref_client = direct(stack)

    async def answer(client: openai.AsyncOpenAI) -> Any:
        if not stream:
            return visible(await client.completions.create(**params, echo=True))
        return [visible(c) async for c in await client.completions.create(**params, echo=True, stream=True)]

    async with through_sidecar(stack, tmp_path) as (client, spool):
        via = await answer(client)
        plain = await answer(ref_client)
        entries = await spool.pending(10)
        assert len(entries) == (2 if stream else 1)  # a guaranteed stream's started record comes first
        assert decode_envelope(entries[0].payload).is_started_record == stream
        env = decode_envelope(entries[-1].payload)
    audit = await ref_client.completions.create(**params, extra_body={"return_token_ids": True})
    await ref_client.close()
    assert via == plain
    want = audit.model_dump()["choices"][0]
    assert isinstance(env.outcome, CapturedOutput)
    assert list(env.outcome.choices[0].token_ids) == want["token_ids"]
    assert env.prompt is not None
    assert list(env.prompt.token_ids) == want["prompt_token_ids"]


async def test_completions_with_several_prompts_record_each_prompt(stack: StackInfo, tmp_path: Path) -> None:
    prompts = [PROMPT, "Water boils at"]
    params: dict[str, Any] = {"model": stack.model_name, "prompt": prompts, "max_tokens": 4, "temperature": 0}
    ref_client = direct(stack)
    async with through_sidecar(stack, tmp_path) as (client, spool):
        raw = await client.completions.with_raw_response.create(**params)
        via = raw.parse()
        plain = await ref_client.completions.create(**params)
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
    audit = await ref_client.completions.create(**params, extra_body={"return_token_ids": True})
    await ref_client.close()
    assert visible(via) == visible(plain)
    want = [c["prompt_token_ids"] for c in audit.model_dump()["choices"]]
    assert env.prompt is not None
    assert env.more_prompts is not None
    assert [list(env.prompt.token_ids)] + [list(p.token_ids) for p in env.more_prompts] == want
    assert isinstance(env.outcome, CapturedOutput)
    assert [c.index for c in env.outcome.choices] == [0, 1]
    assert env.replayable  # choice 0 answers the first prompt: the replayer replays that one


async def test_chat_echo_and_a_refused_top_logprobs_are_as_upstream_answers(stack: StackInfo, tmp_path: Path) -> None:
    """Asking upstream for logprobs on the client's behalf must not change what it answers: under echo vLLM
    scores the prompt with top_logprobs alternatives, and top_logprobs without logprobs is a 400."""
    echo: list[Any] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    params: dict[str, Any] = {"model": stack.model_name, "max_tokens": 3, "temperature": 0}
    ref_client = direct(stack)
    async with through_sidecar(stack, tmp_path) as (client, spool):
        via = await client.chat.completions.create(**params, messages=echo, extra_body={"echo": True})
        plain = await ref_client.chat.completions.create(**params, messages=echo, extra_body={"echo": True})
        refused = []
        for c in (client, ref_client):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(**params, messages=MESSAGES, top_logprobs=3)
            refused.append((err.value.status_code, err.value.body))
        recorded = [decode_envelope(e.payload) for e in await spool.pending(10)]
    await ref_client.close()
    assert visible(via) == visible(plain)
    assert refused[0] == refused[1]
    assert [e.outcome.kind for e in recorded] == ["output", "error"]


async def test_a_completion_without_max_tokens_records_vllms_16(stack: StackInfo, tmp_path: Path) -> None:
    """vLLM's completions request gives an absent max_tokens the legacy default 16: the contract says so (it
    said None, 'up to the context'), and the answer stops there."""
    params: dict[str, Any] = {"model": stack.model_name, "prompt": "Count: 1, 2, 3, 4,", "temperature": 0}
    async with through_sidecar(stack, tmp_path) as (client, spool):
        raw = await client.completions.with_raw_response.create(**params)
        env = await envelope_of(spool, raw.headers["x-reprolane-request-id"])
    answer = raw.parse()
    assert answer.usage is not None
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 16
    assert env.sampling is not None
    assert env.sampling.max_tokens == 16
