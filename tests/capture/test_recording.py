"""Pure recording logic: audit fields added, stripped back, sampling contract with defaults, collection."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from capture.policy import NOT_FLAGGED
from capture.recording import (
    OutputCollector,
    RequestContext,
    build_envelope,
    build_envelope_bytes,
    build_envelope_checked,
    derive_seed,
    prepare,
    prompt_record,
    sampling_contract,
    strip,
)
from schemas import ArtifactHashes, CapturedError, CapturedOutput, Envelope, RuntimeFingerprint, decode_envelope

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_prepare_chat_adds_audit_fields_without_touching_client_body() -> None:
    body = dict(CHAT)
    p = prepare("chat.completions", body, request_id="r", audit_k=4, inject_seed=False)
    assert body == CHAT
    assert p.upstream_body["return_token_ids"] is True
    assert p.upstream_body["logprobs"] is True
    assert p.upstream_body["top_logprobs"] == 4
    assert p.upstream_body["return_tokens_as_token_ids"] is True
    assert not p.client_token_ids
    assert not p.client_logprobs
    assert p.sampling is not None
    assert p.sampling.logprobs == 4


def test_prepare_keeps_client_logprobs_request() -> None:
    p = prepare(
        "completions", {"model": "m", "prompt": "x", "logprobs": 1}, request_id="r", audit_k=5, inject_seed=False
    )
    assert p.upstream_body["logprobs"] == 1
    assert "return_tokens_as_token_ids" not in p.upstream_body
    assert p.client_logprobs
    assert p.sampling is not None
    assert p.sampling.logprobs == 1


def test_sampling_defaults_are_explicit() -> None:
    c = sampling_contract("chat.completions", CHAT, recorded_k=5, seed_injected=False)
    assert (c.temperature, c.top_p, c.top_k, c.min_p) == (1.0, 1.0, 0, 0.0)
    assert (c.repetition_penalty, c.presence_penalty, c.frequency_penalty) == (1.0, 0.0, 0.0)
    assert c.n == 1
    assert c.max_tokens is None
    assert c.seed is None
    assert c.seed_scope == "worker_global"


def test_sampling_maps_fields_and_keeps_other_output_affecting_ones() -> None:
    body = {
        **CHAT,
        "temperature": 0.5,
        "seed": 7,
        "max_completion_tokens": 9,
        "max_tokens": 99,
        "stop": "END",
        "logit_bias": {"42": -100},
        "response_format": {"type": "json_object"},
        "user": "someone",
    }
    c = sampling_contract("chat.completions", body, recorded_k=None, seed_injected=False)
    assert c.seed == 7
    assert c.seed_scope == "per_request"
    assert c.max_tokens == 9
    assert c.stop == ("END",)
    assert c.logit_bias == {"42": -100.0}
    assert c.extra == {"response_format": '{"type":"json_object"}'}


def test_invalid_sampling_value_gives_no_contract() -> None:
    p = prepare("chat.completions", {**CHAT, "temperature": -1}, request_id="r", audit_k=5, inject_seed=False)
    assert p.sampling is None


def test_seed_injection_only_for_sampled_requests_without_seed() -> None:
    sampled = prepare("chat.completions", {**CHAT, "temperature": 0.8}, request_id="r1", audit_k=5, inject_seed=True)
    assert sampled.upstream_body["seed"] == derive_seed("r1")
    assert sampled.sampling is not None
    assert sampled.sampling.seed_injected
    greedy = prepare("chat.completions", {**CHAT, "temperature": 0}, request_id="r1", audit_k=5, inject_seed=True)
    assert "seed" not in greedy.upstream_body
    own = prepare("chat.completions", {**CHAT, "seed": 3}, request_id="r1", audit_k=5, inject_seed=True)
    assert own.upstream_body["seed"] == 3
    assert own.sampling is not None
    assert not own.sampling.seed_injected
    assert derive_seed("r1") == derive_seed("r1")
    assert 0 <= derive_seed("r1") < 2**31


def test_strip_sets_unrequested_fields_to_null_like_vllm() -> None:
    p = prepare("chat.completions", CHAT, request_id="r", audit_k=5, inject_seed=False)
    obj = {"prompt_token_ids": [1, 2], "choices": [{"index": 0, "token_ids": [3], "logprobs": {"content": []}}]}
    strip(obj, p)
    assert obj == {"prompt_token_ids": None, "choices": [{"index": 0, "token_ids": None, "logprobs": None}]}
    no_key = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None}]}
    strip(no_key, p)
    assert "token_ids" not in no_key["choices"][0]  # a key vLLM did not send stays absent


def _chat_step(tid: int, text: str, lp: float, alts: list[tuple[int, float]]) -> dict[str, Any]:
    top = [{"token": f"token_id:{a}", "logprob": v, "bytes": [1]} for a, v in alts]
    return {"token": f"token_id:{tid}", "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top}


def test_collector_merges_stream_chunks_per_choice() -> None:
    col = OutputCollector("chat.completions")
    col.add({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1, 2]})
    col.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hel"},
                    "token_ids": [10],
                    "logprobs": {"content": [_chat_step(10, "Hel", -0.1, [(10, -0.1), (11, -2.0)])]},
                }
            ]
        }
    )
    col.add(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "lo"},
                    "token_ids": [12],
                    "finish_reason": "stop",
                    "logprobs": {"content": [_chat_step(12, "lo", -0.2, [(12, -0.2), (13, -3.0)])]},
                }
            ],
            "system_fingerprint": "vllm-0.32.0-abc",
        }
    )
    (choice,) = col.choices_record()
    assert choice.token_ids == (10, 12)
    assert choice.text == "Hello"
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None
    assert choice.logprobs[1].token == "lo"
    assert [(c.token_id, c.rank) for c in choice.logprobs[1].top] == [(12, 1), (13, 2)]
    assert col.prompt_token_ids == [1, 2]
    assert col.system_fingerprint == "vllm-0.32.0-abc"


def test_collector_completions_ranks_alternatives_by_logprob() -> None:
    col = OutputCollector("completions")
    col.add(
        {
            "choices": [
                {
                    "index": 0,
                    "text": " Paris",
                    "token_ids": [7042],
                    "prompt_token_ids": [5, 6],
                    "logprobs": {
                        "tokens": ["token_id:7042"],
                        "token_logprobs": [-0.3],
                        "top_logprobs": [{"token_id:260": -2.7, "token_id:7042": -0.3}],
                    },
                }
            ]
        }
    )
    (choice,) = col.choices_record()
    assert choice.logprobs is not None
    assert [(c.token_id, c.rank) for c in choice.logprobs[0].top] == [(7042, 1), (260, 2)]
    assert col.prompt_token_ids == [5, 6]


def test_logprobs_dropped_when_not_aligned_with_tokens() -> None:
    col = OutputCollector("chat.completions")
    col.add(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {"content": "ab"},
                    "token_ids": [1, 2],
                    "logprobs": {"content": [_chat_step(1, "a", -0.1, [])]},
                }
            ]
        }
    )
    (choice,) = col.choices_record()
    assert choice.token_ids == (1, 2)
    assert choice.logprobs is None


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


@pytest.mark.parametrize("error", [None, ("upstream_error", 500, "boom")])
def test_build_envelope_output_or_error(error: Any) -> None:
    col = OutputCollector("chat.completions")
    col.add({"choices": [{"index": 0, "message": {"content": "x"}, "token_ids": [9], "finish_reason": "stop"}]})
    ctx = _ctx()
    env = build_envelope(
        ctx,
        model="m",
        artifacts=ArtifactHashes(),
        runtime=RuntimeFingerprint(engine="vllm"),
        prompt=prompt_record([1, 2], "upstream", ctx),
        sampling=None,
        collector=col,
        error=error,
        captured_at=datetime(2026, 1, 1, tzinfo=UTC),
        sidecar_id="s",
    )
    assert env.context.in_flight_at_start == 2
    assert env.outcome.timings.upstream_ms == 12.5
    if error is None:
        assert isinstance(env.outcome, CapturedOutput)
        assert env.outcome.choices[0].token_ids == (9,)
    else:
        assert isinstance(env.outcome, CapturedError)
        assert env.outcome.partial[0].token_ids == (9,)
    assert env.envelope_id() == env.envelope_id()


def test_no_prompt_record_without_ids_or_body() -> None:
    ctx = _ctx()
    assert prompt_record(None, "upstream", ctx) is None
    assert prompt_record([], "tokenize", ctx) is None


# ------------------------------------------------------------------ fast build == careful build, bad values too

_BAD_VALUES: list[Any] = [math.inf, -math.inf, math.nan, "abc", "0.5", None, True, [1], 0, -1, 2**70, 1e308 * 10]


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
                    "logprob": value(-rng.random() * 9),
                    "bytes": [97],
                }
                for _ in range(rng.randint(0, 4))
            ]
            content.append(
                {"token": f"token_id:{tid}", "logprob": value(-rng.random()), "bytes": [98], "top_logprobs": top}
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
    ctx = _ctx()
    kwargs: dict[str, Any] = {
        "model": "m",
        "artifacts": ArtifactHashes(),
        "runtime": RuntimeFingerprint(engine="vllm"),
        "prompt": prompt_record([1, 2], "upstream", ctx),
        "sampling": None,
        "collector": col,
        "error": error,
        "captured_at": datetime(2026, 1, 1, tzinfo=UTC),
        "sidecar_id": "s",
    }
    out: list[Any] = []
    for build in (build_envelope, build_envelope_checked, build_envelope_bytes):
        try:
            out.append(build(ctx, **kwargs))
        except ValidationError as exc:
            out.append(type(exc))
    fast, careful, spooled = out
    assert spooled == (careful.canonical() if isinstance(careful, Envelope) else careful)
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


def test_lone_surrogates_are_replaced_so_the_envelope_stays_encodable() -> None:
    """JSON may carry "\\ud800"; UTF-8 cannot. The recorded text replaces it instead of losing the envelope."""
    from capture.recording import _clean

    assert _clean("ok \ud800 end") == "ok ? end"
    assert _clean("café") == "café"
    assert _clean("plain") == "plain"


def test_spooled_bytes_of_a_clean_answer_take_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above would also hold if `build_envelope_bytes` always fell back: prove it does not."""
    import capture.recording as recording

    col = OutputCollector("chat.completions")
    steps = [_chat_step(11, "a", -0.25, [(12, -2.0), (13, -3.5)]), _chat_step(14, "é", -0.5, [(15, -1.0)])]
    choice = {"index": 0, "message": {"content": "aé"}, "token_ids": [11, 14], "logprobs": {"content": steps}}
    col.add({"choices": [choice]})
    expected = _both(col, None)[1].canonical()

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("fell back to the model path")

    monkeypatch.setattr(recording, "build_envelope", refuse)
    ctx = _ctx()
    data = build_envelope_bytes(
        ctx,
        model="m",
        artifacts=ArtifactHashes(),
        runtime=RuntimeFingerprint(engine="vllm"),
        prompt=prompt_record([1, 2], "upstream", ctx),
        sampling=None,
        collector=col,
        error=None,
        captured_at=datetime(2026, 1, 1, tzinfo=UTC),
        sidecar_id="s",
    )
    assert data == expected
    assert b'"logprob":-3.5,"rank":2' in data
