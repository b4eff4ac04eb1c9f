"""Envelope assembly: the three builders agree on every input, bad upstream values included."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from capture.protocol.output import OutputCollector
from capture.request.assembly import (
    EnvelopeInputs,
    RequestContext,
    build_envelope,
    build_envelope_bytes,
    build_envelope_checked,
    prompt_record,
)
from capture.request.policy import NOT_FLAGGED
from schemas import ArtifactHashes, CapturedError, CapturedOutput, Envelope, RuntimeFingerprint, decode_envelope
from schemas.canonical import canonical_bytes
from tests.capture.protocol.test_output import _chat_step


def _ctx() -> RequestContext:
    return RequestContext(
        request_id="r-1",
        received_at=datetime(2026, 1, 1, tzinfo=UTC),
        tenant="t",
        workflow=None,
        flag=NOT_FLAGGED,
        endpoint="chat.completions",
        stream=False,
        in_flight_at_start=2,
        in_flight_at_end=1,
        body_sha256="e" * 64,
        upstream_ms=12.5,
    )


def inputs(col: OutputCollector | None, error: Any = None) -> EnvelopeInputs:
    return EnvelopeInputs(
        _ctx(),
        model="m",
        artifacts=ArtifactHashes(),
        runtime=RuntimeFingerprint(engine="vllm"),
        prompt=prompt_record([1, 2], "upstream"),
        sampling=None,
        collector=col,
        error=error,
        captured_at=datetime(2026, 1, 1, tzinfo=UTC),
        sidecar_id="s",
    )


@pytest.mark.parametrize("error", [None, ("upstream_error", 500, "boom")])
def test_build_envelope_output_or_error(error: Any) -> None:
    col = OutputCollector("chat.completions")
    col.add({"choices": [{"index": 0, "message": {"content": "x"}, "token_ids": [9], "finish_reason": "stop"}]})
    env = build_envelope(inputs(col, error))
    assert env.context.in_flight_at_start == 2
    assert env.outcome.timings.upstream_ms == 12.5
    if error is None:
        assert isinstance(env.outcome, CapturedOutput)
        assert env.outcome.choices[0].token_ids == (9,)
    else:
        assert isinstance(env.outcome, CapturedError)
        assert env.outcome.partial[0].token_ids == (9,)
    assert env.envelope_id() == env.envelope_id()


def test_no_prompt_record_without_valid_ids() -> None:
    assert prompt_record(None, "upstream") is None
    assert prompt_record([], "tokenize") is None
    assert prompt_record([1, -2], "upstream") is None


# ------------------------------------------------------------------ fast build == careful build, bad values too

_BAD_VALUES: list[Any] = [math.inf, -math.inf, math.nan, "abc", "0.5", None, True, [1], 0, -1, 2**70, 1e308 * 10]


def _logprob(rng: random.Random) -> float:
    """Mostly like a model's, sometimes ~0 (a near-certain token: ``-1.1920928955078125e-07``), 0, or huge."""
    kind = rng.randrange(6)
    if kind == 0:
        return -rng.random() * 10.0 ** rng.randint(-12, -4)
    if kind == 1:
        return rng.choice([0.0, -0.0, -1e-4, -9.999999999999999e-05, -1e16, -1.1920928955078125e-07])
    return -rng.random() * 9


def _random_answer(rng: random.Random) -> dict[str, Any]:
    """A chat answer like vLLM's (return_tokens_as_token_ids, or plain token texts as when the client asked for
    logprobs itself), with a bad value planted now and then."""
    as_ids = rng.random() < 0.7

    def value(good: Any) -> Any:
        return rng.choice(_BAD_VALUES) if rng.random() < 0.03 else good

    choices = []
    for index in range(rng.randint(1, 2)):
        n = rng.randint(0, 6)
        ids = [value(rng.randrange(50_000)) for _ in range(n)]
        content = []
        for tid in ids:
            top = [
                {
                    "token": f"token_id:{value(rng.randrange(50_000))}" if as_ids else rng.choice(["a", "é", '"\\']),
                    "logprob": value(_logprob(rng)),
                    "bytes": [97],
                }
                for _ in range(rng.randint(0, 4))
            ]
            content.append(
                {"token": f"token_id:{tid}", "logprob": value(_logprob(rng)), "bytes": [98], "top_logprobs": top}
            )
        choices.append(
            {
                "index": index,
                "message": {"content": "ab"},
                "token_ids": ids,
                "finish_reason": value("stop"),
                "logprobs": {"content": content} if rng.random() < 0.9 else None,
            }
        )
    return {"choices": choices, "usage": {"completion_tokens": 3}}


def _both(col: OutputCollector, error: Any) -> tuple[Any, Any]:
    """(fast, careful) envelopes, or the exception type each raised; `build_envelope_bytes` (the sidecar's
    path) must give the careful envelope's canonical bytes, or raise the same."""
    out: list[Any] = []
    for build in (build_envelope, build_envelope_checked, build_envelope_bytes):
        try:
            out.append(build(inputs(col, error)))
        except ValidationError as exc:
            out.append(type(exc))
    fast, careful, spooled = out
    if isinstance(careful, Envelope):  # against the reference encoder (json.dumps), not only the fast one
        assert spooled == careful.canonical() == canonical_bytes(careful)
    else:
        assert spooled == careful
    return fast, careful


def test_fast_build_equals_the_careful_build_on_good_and_bad_upstream_values() -> None:
    rng = random.Random(7)
    degraded = 0
    for i in range(300):
        col = OutputCollector("chat.completions")
        col.add(_random_answer(rng))
        fast, careful = _both(col, None if i % 4 else ("upstream_error", 500, "boom"))
        assert fast == careful
        if isinstance(fast, Envelope):
            assert fast.canonical() == careful.canonical()
            assert decode_envelope(fast.canonical()) == fast  # what is spooled is a valid envelope
            choices = fast.outcome.choices if isinstance(fast.outcome, CapturedOutput) else fast.outcome.partial
            degraded += sum(c.logprobs is None and len(c.token_ids) > 0 for c in choices)
    assert degraded > 10  # bad values were planted and handled, not only clean answers


@pytest.mark.parametrize(
    ("where", "bad"),
    [
        ("step", math.inf),
        ("step", math.nan),
        ("alt", -math.inf),
        ("alt", math.nan),
        ("step", "not a number"),
        ("step_id", -5),  # a negative chosen token id
    ],
)
def test_invalid_logprobs_never_make_an_invalid_envelope(where: str, bad: Any) -> None:
    step = _chat_step(11, "a", -0.1, [(12, -2.0)])
    if where == "step":
        step["logprob"] = bad
    elif where == "alt":
        step["top_logprobs"][0]["logprob"] = bad
    else:
        step["token"] = f"token_id:{bad}"
    col = OutputCollector("chat.completions")
    ids = [bad if where == "step_id" else 11]
    col.add({"choices": [{"index": 0, "message": {"content": "a"}, "token_ids": ids, "logprobs": {"content": [step]}}]})
    fast, careful = _both(col, None)
    assert fast == careful
    assert isinstance(fast, Envelope)
    (choice,) = fast.outcome.choices  # type: ignore[union-attr]
    assert choice.token_ids == tuple(ids)  # the token ids still stand
    assert choice.logprobs is None  # the bad step is not recorded
    assert decode_envelope(fast.canonical()) == fast


def test_bad_choice_index_fails_both_ways() -> None:
    col = OutputCollector("chat.completions")
    col.add({"choices": [{"index": -1, "message": {"content": "a"}, "token_ids": [1]}]})
    assert _both(col, None) == (ValidationError, ValidationError)


@pytest.mark.parametrize("near_zero", [-0.25, -1.1920928955078125e-07, -5e-05, 0.0, -1e-4, -1e16, -2.5e300])
def test_spooled_bytes_of_a_clean_answer_take_the_fast_path(monkeypatch: pytest.MonkeyPatch, near_zero: float) -> None:
    """The equality above would also hold if `build_envelope_bytes` always fell back: prove it does not, for
    logprobs msgspec writes as ``repr`` does and for those it spells otherwise (rewritten: ``1.1920928955078125e-07``
    where msgspec writes ``...e-7``, ``-5e-05`` for ``-0.00005``, ``-1e+16`` for ``-1e16``)."""
    import capture.request.assembly as assembly

    col = OutputCollector("chat.completions")
    steps = [_chat_step(11, "a", near_zero, [(12, -2.0), (13, -3.5)]), _chat_step(14, "é", -0.5, [(15, near_zero)])]
    choice = {"index": 0, "message": {"content": "aé"}, "token_ids": [11, 14], "logprobs": {"content": steps}}
    col.add({"choices": [choice]})
    expected = _both(col, None)[1].canonical()

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("fell back to the model path")

    monkeypatch.setattr(assembly, "build_envelope", refuse)
    data = build_envelope_bytes(inputs(col))
    assert data == expected
    assert b'"logprob":-3.5,"rank":2' in data
    assert f'"logprob":{near_zero!r},"token":"a"'.encode() in data


CALLS = [
    {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    {"id": "call-2", "type": "function", "function": {"name": "lookup_policy", "arguments": '{"number": "1"}'}},
]


def test_tool_calls_are_recorded_from_a_whole_answer_and_from_a_stream_alike() -> None:
    """The calls upstream parsed, by call index, whether they came whole or in pieces (and through every builder)."""
    whole = OutputCollector("chat.completions")
    message = {"content": None, "tool_calls": CALLS}
    step = _chat_step(11, "<", -0.1, [(12, -2.0)])
    whole.add({"choices": [{"index": 0, "message": message, "token_ids": [11], "logprobs": {"content": [step]}}]})
    stream = OutputCollector("chat.completions")
    for call_index, call in enumerate(CALLS):
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        for piece in (
            {"id": call["id"], "function": {"name": name, "arguments": ""}},
            {"function": {"arguments": arguments[:5]}},
            {"function": {"arguments": arguments[5:]}},
        ):
            stream.add({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": call_index, **piece}]}}]})
    stream.add({"choices": [{"index": 0, "delta": {}, "token_ids": [11], "logprobs": {"content": [step]}}]})
    for col in (whole, stream):
        fast, careful = _both(col, None)
        assert fast == careful
        assert isinstance(fast, Envelope)
        (choice,) = fast.outcome.choices  # type: ignore[union-attr]
        assert [(c.id, c.name, c.arguments) for c in choice.tool_calls or ()] == [
            ("call-1", "get_weather", '{"city": "Oslo"}'),
            ("call-2", "lookup_policy", '{"number": "1"}'),
        ]
        assert decode_envelope(fast.canonical()) == fast


def test_an_invalid_tool_call_keeps_the_output() -> None:
    """A tool call name past the contract's bound (hostile upstream) is dropped; the token ids still stand."""
    col = OutputCollector("chat.completions")
    bad = [{"id": "x", "function": {"name": "n" * 5000, "arguments": "{}"}}]
    col.add({"choices": [{"index": 0, "message": {"content": None, "tool_calls": bad}, "token_ids": [7]}]})
    fast, careful = _both(col, None)
    assert fast == careful
    assert isinstance(fast, Envelope)
    (choice,) = fast.outcome.choices  # type: ignore[union-attr]
    assert choice.token_ids == (7,)
    assert choice.tool_calls is None


def test_a_responses_function_call_is_recorded() -> None:
    col = OutputCollector("responses")
    item = {"type": "function_call", "call_id": "fc-1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
    col.add({"object": "response", "status": "completed", "output": [item], "model": "m"})
    (choice,) = col.choices_record()
    assert choice.tool_calls is not None
    assert [(c.id, c.name, c.arguments) for c in choice.tool_calls] == [("fc-1", "get_weather", '{"city": "Oslo"}')]
