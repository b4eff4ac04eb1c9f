"""Pure recording logic: audit fields added, stripped back, sampling contract with defaults, collection."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from capture.recording import (
    BUILTIN_DEFAULTS,
    OutputCollector,
    SamplingDefaults,
    derive_seed,
    prepare,
    sampling_contract,
    strip,
)
from schemas.envelope_codec import TopRow

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


def test_contracts_are_reused_for_the_same_fields_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import capture.recording as recording

    def contract(body: dict[str, Any], prompt: str = "hi") -> Any:
        return prepare(
            "chat.completions",
            {**body, "messages": [{"role": "user", "content": prompt}]},
            request_id="r",
            audit_k=5,
            inject_seed=False,
        ).sampling

    same = contract({**CHAT, "temperature": 0.5, "foo": 1})
    assert contract({**CHAT, "temperature": 0.5, "foo": 1}, prompt="another prompt") is same  # cached
    # 1, 1.0 and true are equal in Python, not in a contract: each its own
    assert [contract({**CHAT, "temperature": 0.5, "foo": v}).extra["foo"] for v in (1, 1.0, True)] == [
        "1",
        "1.0",
        "true",
    ]
    assert contract({**CHAT, "temperature": 0.7, "foo": 1}).temperature == 0.7
    assert contract({**CHAT, "temperature": -1}) is None  # invalid, cached as such
    assert contract({**CHAT, "temperature": -1}) is None
    listed = contract({**CHAT, "stop": ["a"]})
    assert contract({**CHAT, "stop": ["a"]}) is not listed  # lists and objects are not keys: validated each time
    assert contract({**CHAT, "stop": ["b"]}).stop == ("b",)
    monkeypatch.setattr(recording, "_MAX_CONTRACTS", 3)
    for t in range(10):
        assert contract({**CHAT, "temperature": t / 10}).temperature == t / 10
        assert len(recording._CONTRACTS) <= 3


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
    original = copy.deepcopy(obj)
    assert strip(obj, p) == {"prompt_token_ids": None, "choices": [{"index": 0, "token_ids": None, "logprobs": None}]}
    assert obj == original  # recorded after the answer is sent: strip must not touch it
    no_key = {"choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None}]}
    assert strip(no_key, p) is no_key  # nothing to strip: no copy
    assert "token_ids" not in no_key["choices"][0]  # a key vLLM did not send stays absent
    assert strip([1], p) == [1]
    body = {**CHAT, "logprobs": True, "return_token_ids": True}
    asked = prepare("chat.completions", body, request_id="r", audit_k=5, inject_seed=False)
    assert strip(obj, asked) is obj


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


def test_lone_surrogates_are_replaced_so_the_envelope_stays_encodable() -> None:
    """JSON may carry "\\ud800"; UTF-8 cannot. The recorded text replaces it instead of losing the envelope."""
    from capture.recording import _clean

    assert _clean("ok \ud800 end") == "ok ? end"
    assert _clean("café") == "café"
    assert _clean("plain") == "plain"


def test_token_id_spellings_are_parsed_and_only_short_ones_are_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's token strings are cached by text: a long one (a broken or hostile upstream) must not be, and
    the cache stays bounded."""
    import capture.recording as recording

    recording._SPELLINGS.clear()
    assert recording._id_spelling("token_id:42") == (42, list(b"token_id:42"))
    assert recording._id_spelling("token_id:x") is None
    assert recording._id_spelling("The") is None
    assert list(recording._SPELLINGS) == ["token_id:42"]
    huge = "token_id:" + "7" * 10_000
    assert recording._id_spelling(huge) is None
    col = OutputCollector("chat.completions")
    col.add(
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [7],
                    "logprobs": {
                        "content": [
                            {
                                "token": "token_id:7",
                                "logprob": -0.5,
                                "bytes": [97],
                                "top_logprobs": [{"token": huge, "logprob": -0.5, "bytes": [97]}],
                            }
                        ]
                    },
                }
            ]
        }
    )
    assert list(recording._SPELLINGS) == ["token_id:42", "token_id:7"]  # the long one is not kept
    monkeypatch.setattr(recording, "_MAX_SPELLINGS", 3)
    for n in range(10):
        assert recording._id_spelling(f"token_id:{n}") == (n, list(f"token_id:{n}".encode()))
        assert len(recording._SPELLINGS) <= 3
    step = col.choices[0].steps[0]
    assert step.token == "a"
    assert step.top == [TopRow(-0.5, 1, huge, None)]  # kept as text, as any text that is not a token id


# ------------------------------------------------------------------ echo and several prompts (completions)


def _echo(body: dict[str, Any]) -> Any:
    return prepare("completions", {"model": "m", "echo": True, **body}, request_id="r", audit_k=5, inject_seed=False)


def test_echo_asks_for_token_ids_but_no_logprobs() -> None:
    p = _echo({"prompt": "The sky is"})
    assert p.upstream_body["return_token_ids"] is True
    # logprobs under echo make vLLM score every prompt token: never asked for on the client's behalf
    assert "logprobs" not in p.upstream_body
    assert "return_tokens_as_token_ids" not in p.upstream_body
    assert p.sampling is not None
    assert p.sampling.logprobs is None
    assert p.echo is not None
    assert not p.echo.pending()


def test_echo_of_an_unknown_prompt_shape_does_not_ask_for_token_ids() -> None:
    p = _echo({"prompt": [{"odd": 1}]})
    assert p.echo is None
    assert "return_token_ids" not in p.upstream_body


def test_echo_with_client_token_ids_is_left_as_upstream_answers() -> None:
    p = _echo({"prompt": "x", "return_token_ids": True})
    assert p.echo is None
    answer = {"choices": [{"index": 0, "text": " y", "token_ids": [7], "prompt_token_ids": [5]}]}
    assert strip(answer, p) is answer


def test_echo_puts_the_prompt_text_back_for_each_prompt_and_choice() -> None:
    p = _echo({"prompt": ["A", "B"], "n": 2})
    answer = {
        "choices": [
            {"index": i, "text": f" t{i}", "token_ids": [i], "prompt_token_ids": [9], "logprobs": None}
            for i in range(4)
        ]
    }
    before = copy.deepcopy(answer)
    out = strip(answer, p)
    assert [c["text"] for c in out["choices"]] == ["A t0", "A t1", "B t2", "B t3"]
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None for c in out["choices"])
    assert answer == before  # what was recorded stays as upstream said it


def test_echo_stream_puts_the_text_back_once_per_choice_and_keeps_its_prompt_ids() -> None:
    p = _echo({"prompt": "The sky is", "stream": True, "n": 2, "temperature": 1.0})
    first = {"choices": [{"index": 1, "text": " a", "token_ids": [5, 6, 7], "prompt_token_ids": [5, 6]}]}
    later = {"choices": [{"index": 1, "text": " b", "token_ids": [8], "prompt_token_ids": None}]}
    other = {"choices": [{"index": 0, "text": " c", "token_ids": [9], "prompt_token_ids": [5, 6]}]}
    assert strip(first, p)["choices"][0] == {
        "index": 1,
        "text": "The sky is a",
        "token_ids": None,
        "prompt_token_ids": [5, 6],  # an echoed stream carries them whether or not they were asked for
    }
    assert strip(later, p)["choices"][0]["text"] == " b"
    assert strip(other, p)["choices"][0]["text"] == "The sky is c"


def test_echo_of_token_id_prompts_waits_for_their_text_and_can_be_abandoned() -> None:
    p = _echo({"prompt": [[1, 2], [3]]})
    assert p.echo is not None
    assert p.echo.pending() == [(0, [1, 2]), (1, [3])]
    p.echo.resolve(0, "<s>hi")
    p.echo.resolve(1, "yo")
    assert p.echo.pending() == []
    out = strip({"choices": [{"index": 1, "text": "!"}]}, p)
    assert out["choices"][0]["text"] == "yo!"
    p.echo.abandon()
    assert strip({"choices": [{"index": 0, "text": "x"}]}, p)["choices"][0]["text"] == "x"


def _completion_logprobs(tokens: list[int]) -> dict[str, Any]:
    return {
        "tokens": [f"token_id:{t}" for t in tokens],
        "token_logprobs": [None if i == 0 else -0.5 - i for i in range(len(tokens))],
        "top_logprobs": [None] + [{f"token_id:{t}": -0.5 - i} for i, t in enumerate(tokens) if i],
    }


def test_echo_collector_keeps_the_generated_steps_only() -> None:
    p = _echo({"prompt": "x", "logprobs": 1})
    collector = OutputCollector("completions", echo=p.echo)
    # upstream's echoed logprobs: 3 prompt positions, then 2 generated tokens
    lp = _completion_logprobs([5, 6, 7, 8, 9])
    collector.add({"choices": [{"index": 0, "text": " ab", "token_ids": [8, 9], "logprobs": lp}]})
    (choice,) = collector.choices_record()
    assert choice.logprobs is not None
    assert [s.token_id for s in choice.logprobs] == [8, 9]
    assert [s.logprob for s in choice.logprobs] == [-3.5, -4.5]


def test_echo_without_generation_records_no_logprobs() -> None:
    p = _echo({"prompt": "x", "logprobs": 1, "max_tokens": 0})
    collector = OutputCollector("completions", echo=p.echo)
    collector.add({"choices": [{"index": 0, "text": "", "token_ids": [8], "logprobs": _completion_logprobs([5, 6])}]})
    (choice,) = collector.choices_record()
    assert choice.logprobs is None


def test_several_prompts_are_counted_and_collected_per_choice() -> None:
    p = prepare(
        "completions", {"model": "m", "prompt": ["a", "b", "c"], "n": 2}, request_id="r", audit_k=5, inject_seed=False
    )
    assert (p.prompts, p.n) == (3, 2)
    for spelled in (2.0, "2"):  # vLLM reads these as 2 too: choice i still answers prompt i // 2
        body = {"model": "m", "prompt": ["a", "b"], "n": spelled}
        assert prepare("completions", body, request_id="r", audit_k=5, inject_seed=False).n == 2
    assert (
        prepare(
            "completions", {"model": "m", "prompt": [1, 2, 3]}, request_id="r", audit_k=5, inject_seed=False
        ).prompts
        == 1
    )
    collector = OutputCollector("completions")
    collector.add(
        {"choices": [{"index": i, "text": "", "token_ids": [1], "prompt_token_ids": [10 + i // 2]} for i in range(6)]}
    )
    assert collector.prompt_token_ids == [10]
    assert {i: collector.choice_prompts[i] for i in (0, 2, 4)} == {0: [10], 2: [11], 4: [12]}


@pytest.mark.parametrize("extra", [{"top_logprobs": 3}, {"logprobs": False, "top_logprobs": 3}, {"top_logprobs": "x"}])
def test_chat_top_logprobs_without_logprobs_is_left_for_upstream_to_refuse(extra: dict[str, Any]) -> None:
    """vLLM answers 400 to these; asking for logprobs on the client's behalf would turn that into a 200."""
    p = prepare("chat.completions", {**CHAT, **extra}, request_id="r", audit_k=5, inject_seed=False)
    assert p.upstream_body == {**CHAT, **extra, "return_token_ids": True}
    assert (
        prepare(
            "chat.completions", {**CHAT, "top_logprobs": 0}, request_id="r", audit_k=5, inject_seed=False
        ).upstream_body["top_logprobs"]
        == 5
    )  # 0 is valid without logprobs: audited as usual


def test_chat_echo_asks_for_no_logprobs() -> None:
    """Under echo vLLM returns the prompt's logprobs with top_logprobs alternatives: audit k would show there."""
    p = prepare("chat.completions", {**CHAT, "echo": True}, request_id="r", audit_k=5, inject_seed=False)
    assert p.upstream_body == {**CHAT, "echo": True, "return_token_ids": True}
    assert p.echo is None  # chat's echo keeps its text with token ids


def test_left_out_fields_record_upstreams_defaults_and_the_cache_keeps_them_apart() -> None:
    model = SamplingDefaults({"temperature": 0.0, "top_k": 20, "max_tokens": 64})
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    with_model = prepare("chat.completions", body, request_id="rl-1", audit_k=5, inject_seed=True, defaults=model)
    builtin = prepare("chat.completions", body, request_id="rl-1", audit_k=5, inject_seed=True)
    assert with_model.sampling is not None
    assert builtin.sampling is not None
    assert (with_model.sampling.temperature, with_model.sampling.top_k, with_model.sampling.max_tokens) == (0.0, 20, 64)
    assert (builtin.sampling.temperature, builtin.sampling.top_k, builtin.sampling.max_tokens) == (1.0, 0, None)
    # greedy by the model's default: no seed injected (a sampled request by vLLM's own default gets one)
    assert "seed" not in with_model.upstream_body
    assert with_model.sampling.seed_scope == "none"
    assert builtin.sampling.seed_injected


@pytest.mark.parametrize("temperature", [0, 0.0, "0", "0.0"])
def test_no_seed_is_injected_into_a_greedy_request_however_spelled(temperature: object) -> None:
    body = {"model": "m", "prompt": "Hi", "temperature": temperature}
    p = prepare("completions", body, request_id="rl-1", audit_k=5, inject_seed=True)
    assert "seed" not in p.upstream_body


def test_max_tokens_left_out_is_recorded_as_vllm_reads_it() -> None:
    """vLLM's completions request defaults an absent max_tokens to 16; null, and chat's, mean the model's
    default, else the rest of the context (None)."""
    model = SamplingDefaults({"max_tokens": 64})

    def recorded(endpoint: Any, body: dict[str, Any], defaults: SamplingDefaults = BUILTIN_DEFAULTS) -> Any:
        body = {"model": "m", **body}
        p = prepare(endpoint, body, request_id="rl-1", audit_k=5, inject_seed=False, defaults=defaults)
        assert p.sampling is not None
        return p.sampling.max_tokens

    assert recorded("completions", {"prompt": "Hi"}) == 16
    assert recorded("completions", {"prompt": "Hi"}, model) == 16
    assert recorded("completions", {"prompt": "Hi", "max_tokens": None}) is None
    assert recorded("completions", {"prompt": "Hi", "max_tokens": None}, model) == 64
    assert recorded("chat.completions", {"messages": CHAT["messages"]}) is None
    assert recorded("chat.completions", {"messages": CHAT["messages"]}, model) == 64
    assert recorded("chat.completions", {"messages": CHAT["messages"], "max_completion_tokens": 5}, model) == 5
