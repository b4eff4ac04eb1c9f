from __future__ import annotations

import json

import pytest

from schemas import ContractError, DivergenceEvent, decode_divergence, decode_replay_request
from schemas.layout import envelope_key, replay_key, request_index_key, workflow_index_key
from schemas.replay import replay_result_id
from tests.factories import FIXED_TIME, runtime


def event(**overrides: object) -> DivergenceEvent:
    lane = runtime(max_num_seqs=1)
    base: dict[str, object] = {
        "request_id": "req-1",
        "envelope_id": "e" * 64,
        "lane": "vllm-fixed",
        "lane_fingerprint": lane,
        "lane_fingerprint_sha256": lane.sha256(),
        "verdict": "bitwise",
        "levels_held": ("bitwise", "token", "numeric"),
        "target_level": "token",
        "target_met": True,
        "token_match_rate": 1.0,
        "recorded_length": 3,
        "replayed_length": 3,
        "length_diff": 0,
        "cause_hint": "identical",
        "replayed_at": FIXED_TIME,
        "replay_ms": 12.5,
    }
    base.update(overrides)
    return DivergenceEvent.model_validate(base)


def test_event_round_trip() -> None:
    ev = event()
    assert decode_divergence(ev.model_dump_json()) == ev


def test_result_id_is_idempotent_by_envelope_and_lane() -> None:
    a = event()
    b = event(replay_ms=99.0, replayed_at=FIXED_TIME.replace(hour=10))
    assert a.result_id() == b.result_id() == replay_result_id("e" * 64, a.lane_fingerprint_sha256)
    other_lane = runtime(max_num_seqs=2)
    c = event(lane_fingerprint=other_lane, lane_fingerprint_sha256=other_lane.sha256())
    assert c.result_id() != a.result_id()


def test_bad_replay_request_names_field() -> None:
    with pytest.raises(ContractError) as info:
        decode_replay_request(json.dumps({"request_id": "ok-1", "lane": 3}))
    assert info.value.fields == ("lane",)
    with pytest.raises(ContractError):
        decode_replay_request(b"not json")


def test_key_layout() -> None:
    assert envelope_key("f" * 64, "acme", FIXED_TIME) == f"envelopes/tenant=acme/date=2026-07-14/{'f' * 64}.json"
    assert request_index_key("req-1") == "index/request-id/req-1.json"
    assert workflow_index_key("wf-1", 3, "req-9") == "index/workflow/wf-1/000003-req-9.json"
    assert replay_key("e" * 64, "r" * 64, FIXED_TIME).startswith("replays/date=2026-07-14/")
