"""Collecting upstream's output per choice, from a whole body or stream chunks, for both endpoints."""

from __future__ import annotations

from typing import Any

from capture.protocol.output import OutputCollector


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
