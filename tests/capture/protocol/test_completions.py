"""The completions endpoint: the echoed prompt put back, and requests with several prompts."""

from __future__ import annotations

import copy
from typing import Any

from capture.protocol.audit_fields import prepare, strip
from capture.protocol.output import OutputCollector


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
