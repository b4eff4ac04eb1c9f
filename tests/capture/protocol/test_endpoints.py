"""`capture.protocol.endpoints`: one object per endpoint, every endpoint listed once."""

from __future__ import annotations

from typing import get_args

import pytest

from capture.protocol import chat
from capture.protocol.endpoints import ENDPOINTS, EndpointProtocol
from capture.protocol.output import OutputCollector
from schemas.envelope import Endpoint


def test_every_endpoint_of_the_envelope_has_its_protocol_and_its_own_path() -> None:
    assert sorted(ENDPOINTS) == sorted(get_args(Endpoint))
    assert all(protocol.name == name for name, protocol in ENDPOINTS.items())
    paths = [protocol.path for protocol in ENDPOINTS.values()]
    assert len(set(paths)) == len(paths)
    assert all(p.startswith("/v1/") for p in paths)
    assert {n for n, p in ENDPOINTS.items() if p.typed} == {"responses", "messages"}


def test_an_endpoint_reads_its_answer_one_way() -> None:
    with pytest.raises(ValueError, match="either by choices or by its own collect"):
        EndpointProtocol(
            name="chat.completions", path="/x", ask=lambda b, u, k: (False, False, None), max_tokens=lambda b: None,
            tokenize_doc=lambda b: None, error_of=lambda o: None,
        )  # fmt: skip
    with pytest.raises(ValueError, match="either by choices or by its own collect"):
        EndpointProtocol(
            name="chat.completions", path="/x", ask=lambda b, u, k: (False, False, None), max_tokens=lambda b: None,
            tokenize_doc=lambda b: None, error_of=lambda o: None, choices=chat, collect=lambda c, o: None,
        )  # fmt: skip


def test_a_streamed_error_is_recorded_only_where_it_holds_part_of_the_answer() -> None:
    chat_collector = OutputCollector("chat.completions")
    said = ENDPOINTS["chat.completions"].read_event(chat_collector, {"error": {"message": "boom"}})
    assert said == (True, {"message": "boom"})
    assert ENDPOINTS["chat.completions"].read_event(chat_collector, {"error": None}) == (True, None)  # still one
    assert chat_collector.chunks == 0
    typed = OutputCollector("responses")
    failed = {"type": "response.failed", "response": {"object": "response", "error": "x", "output": []}}
    assert ENDPOINTS["responses"].read_event(typed, failed) == (True, "x")
    assert typed.chunks == 1


@pytest.mark.parametrize(
    ("endpoint", "body", "bound"),
    [
        ("chat.completions", {"max_completion_tokens": 5, "max_tokens": 9}, 5),
        ("chat.completions", {"max_tokens": 9}, 9),
        ("chat.completions", {}, None),
        ("completions", {}, 16),  # vLLM's default for an absent one
        ("completions", {"max_tokens": None}, None),
        ("responses", {"max_tokens": 7}, 7),  # the chat spelling of max_output_tokens (contract_body)
    ],
)
def test_the_output_bound_is_read_as_upstream_reads_it(
    endpoint: Endpoint, body: dict[str, int | None], bound: int | None
) -> None:
    assert ENDPOINTS[endpoint].max_tokens(body) == bound
