"""`infra.demo.kafka`: the demo finds a request's records by its request id, whatever the Kafka key."""

from __future__ import annotations

from types import SimpleNamespace

from infra.demo.kafka import _request_id
from schemas.layout import HEADER_REQUEST_ID


def test_an_envelope_is_found_by_its_request_id_header_and_an_event_by_its_key() -> None:
    envelope = SimpleNamespace(key=b"http://127.0.0.1:8000", headers=[(HEADER_REQUEST_ID, b"rl-1"), ("x", b"y")])
    assert _request_id(envelope) == "rl-1"  # keyed by the engine it ran on
    assert _request_id(SimpleNamespace(key=b"rl-2", headers=[])) == "rl-2"  # a divergence event
    assert _request_id(SimpleNamespace(key=None, headers=None)) == ""
