"""`capture.protocol.responses`: the audit fields of a Responses request, its answer collected (whole and
streamed) and stripped; shapes as vLLM 0.32 writes them (from real answers), and hostile ones."""

from __future__ import annotations

import copy
from typing import Any

from capture.protocol import responses
from capture.protocol.audit_fields import prepare, strip
from capture.protocol.output import OutputCollector
from capture.protocol.sse import split_typed_data

PROMPT_IDS = [1, 9690, 198, 2683, 2, 198, 1, 520, 9531, 198]
OUT_IDS = [60, 23, 39614]


def step(token: str, logprob: float, *alts: tuple[str, float]) -> dict[str, Any]:
    top = [{"token": t, "bytes": list(t.encode()), "logprob": lp} for t, lp in alts]
    return {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": top}


def answer(*, logprobs: bool = True, messages: bool = True, status: str = "incomplete") -> dict[str, Any]:
    steps = [step("L", -1.8, ("L", -1.8), ("The", -1.9)), step("'", -0.4, ("'", -0.4)), step("É", -0.9, ("É", -0.9))]
    return {
        "id": "resp_1",
        "object": "response",
        "model": "m",
        "status": status,
        "top_logprobs": 2 if logprobs else None,
        "output": [
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "L'É", "annotations": [], "logprobs": steps if logprobs else None}
                ],
            }
        ],
        "usage": {
            "input_tokens": 10,
            "output_tokens": 3,
            "total_tokens": 13,
            "input_tokens_details": {"cached_tokens": 0},
        },
        "input_messages": [{"message": "x", "tokens": PROMPT_IDS, "type": "raw_message_tokens"}] if messages else None,
        "output_messages": [{"message": "L'É", "tokens": OUT_IDS, "type": "raw_message_tokens"}] if messages else None,
    }


def prepared(body: dict[str, Any] | None = None, **kw: Any) -> Any:
    base = {"model": "m", "input": "What?", "max_output_tokens": 8, "temperature": 0}
    return prepare(
        "responses", {**base, **(body or {})}, request_id="rl-1", audit_k=5, inject_seed=kw.get("seed", False)
    )


def test_the_sidecar_asks_for_token_ids_and_logprobs_and_records_the_contract() -> None:
    p = prepared()
    assert p.upstream_body["enable_response_messages"] is True
    assert p.upstream_body["include"] == [responses.LOGPROBS_INCLUDE]
    assert p.upstream_body["top_logprobs"] == 5
    assert (p.client_token_ids, p.client_logprobs) == (False, False)
    assert p.sampling is not None
    assert (p.sampling.max_tokens, p.sampling.temperature, p.sampling.logprobs) == (8, 0.0, 5)
    assert p.sampling.extra == {}  # input, include, top_logprobs... shape the prompt or the answer's form
    assert p.limits == responses.LIMITS


def test_the_clients_own_logprobs_are_left_as_asked() -> None:
    p = prepared({"include": [responses.LOGPROBS_INCLUDE], "top_logprobs": 2, "enable_response_messages": True})
    assert p.upstream_body["top_logprobs"] == 2
    assert (p.client_token_ids, p.client_logprobs) == (True, True)
    assert p.sampling is not None
    assert p.sampling.logprobs == 2
    bad = prepared({"include": "message.output_text.logprobs"})  # not a list: upstream's to refuse
    assert bad.upstream_body["include"] == "message.output_text.logprobs"
    assert bad.sampling is not None
    assert bad.sampling.logprobs is None


def test_a_sampled_request_gets_a_seed_and_its_text_format_is_its_constraint() -> None:
    p = prepared({"temperature": 0.7, "text": {"format": {"type": "json_object"}}, "bad_words": ["x"]}, seed=True)
    assert isinstance(p.upstream_body["seed"], int)
    assert p.sampling is not None
    assert (p.sampling.seed_injected, p.sampling.seed_scope) == (True, "per_request")
    assert set(p.sampling.extra) == {"bad_words"}
    assert p.sampling.constraint is not None
    assert p.sampling.constraint.text == '{"format":{"type":"json_object"}}'
    assert p.sampling.constraint.constrains


def test_a_whole_answer_is_recorded_with_ids_and_aligned_logprobs() -> None:
    c = OutputCollector("responses")
    c.add(answer())
    assert c.prompt_token_ids == PROMPT_IDS
    (choice,) = c.choices_record()
    assert list(choice.token_ids) == OUT_IDS
    assert (choice.text, choice.finish_reason) == ("L'É", "length")
    assert choice.logprobs is not None
    assert [s.token_id for s in choice.logprobs] == OUT_IDS
    assert [s.token for s in choice.logprobs] == ["L", "'", "É"]
    assert [(t.token, t.token_id, t.rank) for t in choice.logprobs[0].top] == [("L", None, 1), ("The", None, 2)]
    assert c.usage == {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}
    assert c.logprobs_texts() is not None


def test_logprobs_that_do_not_align_with_the_ids_are_not_recorded() -> None:
    doc = answer()
    doc["output_messages"][0]["tokens"] = [*OUT_IDS, 5, 6]
    c = OutputCollector("responses")
    c.add(doc)
    (choice,) = c.choices_record()
    assert len(choice.token_ids) == 5
    assert choice.logprobs is None
    assert not set(responses.TEXTLESS_LAST) & c.limits


def test_a_stream_one_step_short_of_its_ids_says_its_last_token_had_no_logprob() -> None:
    """vLLM's streamed answer ending with the end-of-sequence token (no text, so no delta and no logprob)."""
    done = answer(status="completed")
    done["output_messages"][0]["tokens"] = [*OUT_IDS, 2]
    c = OutputCollector("responses")
    c.add({"type": "response.completed", "response": done})
    (choice,) = c.choices_record()
    assert list(choice.token_ids) == [*OUT_IDS, 2]
    assert choice.logprobs is None
    assert set(responses.TEXTLESS_LAST) <= c.limits


def test_a_stream_is_read_from_its_terminal_event_and_a_broken_one_keeps_its_text() -> None:
    c = OutputCollector("responses")
    c.add({"type": "response.created", "response": {**answer(), "status": "in_progress", "output": []}})
    c.add({"type": "response.output_text.delta", "delta": "L'", "logprobs": []})
    assert not c.ended
    assert c.choices_record()[0].text == "L'"
    c.add({"type": "response.completed", "response": answer(status="completed")})
    assert c.ended
    (choice,) = c.choices_record()
    assert (choice.text, choice.finish_reason, list(choice.token_ids)) == ("L'É", "stop", OUT_IDS)


def test_several_turns_record_no_output_ids_and_say_so() -> None:
    doc = answer()
    doc["output_messages"] = doc["output_messages"] * 2
    c = OutputCollector("responses")
    c.add(doc)
    assert c.choices_record()[0].token_ids == ()
    assert c.limits == set(responses.MULTI_TURN)


def test_hostile_shapes_do_not_raise() -> None:
    for doc in (
        {"object": "response", "output": "x", "input_messages": [{"tokens": ["a"]}], "usage": [1]},
        {
            "object": "response",
            "output": [{"type": "message", "content": [{"type": "output_text", "logprobs": [1, None]}]}],
        },
        {"type": "response.completed", "response": {"status": 3, "output_messages": "x"}},
        {"type": "response.output_text.delta", "delta": 7},
        {"type": "response.in_progress", "response": {"model": 1}},
    ):
        c = OutputCollector("responses")
        c.add(doc)
        c.choices_record()
        c.choices_data()


def test_strip_gives_the_client_what_it_gets_unasked_and_leaves_the_record() -> None:
    p = prepared()
    doc = answer()
    kept = copy.deepcopy(doc)
    out = strip(doc, p)
    assert doc == kept
    unasked = answer(logprobs=False, messages=False)
    assert out == unasked
    event = {"type": "response.completed", "response": answer(), "sequence_number": 9}
    assert strip(event, p) == {**event, "response": unasked}
    delta = {"type": "response.output_text.delta", "delta": "L", "logprobs": [step("L", -1.8)]}
    assert strip(delta, p)["logprobs"] == []
    part = {"type": "response.content_part.done", "part": answer()["output"][0]["content"][0]}
    assert strip(part, p)["part"]["logprobs"] is None
    item = {"type": "response.output_item.done", "item": answer()["output"][0]}
    assert strip(item, p)["item"]["content"][0]["logprobs"] is None
    added = {"type": "response.content_part.added", "part": {"type": "output_text", "text": "", "logprobs": []}}
    assert strip(added, p) == added
    asked = prepared({"include": [responses.LOGPROBS_INCLUDE], "enable_response_messages": True})
    assert strip(answer(), asked) == answer()


def test_a_typed_event_is_cut_around_its_data_line() -> None:
    event = b'event: response.output_text.delta\ndata: {"delta":"L"}\n\n'
    assert split_typed_data(event) == (b"event: response.output_text.delta\ndata: ", b'{"delta":"L"}', b"\n\n")
    crlf = b"event: x\r\ndata:{}\r\n\r\n"
    assert split_typed_data(crlf) == (b"event: x\r\ndata:", b"{}", b"\r\n\r\n")
    assert split_typed_data(b"data: {}\n\n") == (b"data: ", b"{}", b"\n\n")
    assert split_typed_data(b"event: x\n\n") is None
    assert split_typed_data(b"event: x\ndata: {\ndata: }\n\n") is None  # two data lines: not one document
    assert split_typed_data(b"".join(b": c\n" for _ in range(20)) + b"data: {}\n\n") is None
