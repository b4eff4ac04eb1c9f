"""The client side of on-demand replays (`replayer.on_demand`): which key signs, which message is the answer.

The round trip itself (a real ``reprolane serve replayer``, the real CLI, heartbeats, refusal and fallback; the
schedule lane's answer taken) is in tests/replayer/test_cli_service_stack.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from replayer.errors import ServiceReplayError
from replayer.on_demand import _answer, _heartbeat, accept, sign
from replayer.replay import replay_envelope
from replayer.request_keys import load_replay_request_keys
from replayer.settings import ReplayerSettings
from schemas import DivergenceEvent, ReplayRequest
from schemas.canonical import canonical_bytes
from schemas.layout import HEADER_DLQ_REASON
from schemas.replay import AdvertisedLane, ReplayerHeartbeat, decode_heartbeat
from schemas.replay_auth import verify_replay_request
from tests.replayer.support import REPLAY_KEY_ID, write_replay_request_keys

SHA = "ab" * 32


@dataclass
class Record:
    value: object
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def test_the_files_only_replay_key_signs_and_the_replayer_accepts_it(tmp_path: Path) -> None:
    path = write_replay_request_keys(tmp_path / "keys.json")
    signed = sign(ReplayRequest(request_id="r-1", reply_to="cli-1"), ReplayerSettings(replay_request_keys_path=path))
    assert signed.key_id == REPLAY_KEY_ID
    assert verify_replay_request(signed, load_replay_request_keys(path)) is None


def test_several_replay_keys_need_a_key_id(tmp_path: Path) -> None:
    keys = {name: {"secret": "cd" * 16, "roles": ["replay"]} for name in ("a", "b")}
    path = write_replay_request_keys(tmp_path / "keys.json", keys)
    request = ReplayRequest(request_id="r-1")
    with pytest.raises(ServiceReplayError, match="has 2 keys with the 'replay' role: name the one"):
        sign(request, ReplayerSettings(replay_request_keys_path=path))
    assert sign(request, ReplayerSettings(replay_request_keys_path=path, replay_request_key_id="b")).key_id == "b"
    with pytest.raises(ServiceReplayError, match="no key 'c'"):
        sign(request, ReplayerSettings(replay_request_keys_path=path, replay_request_key_id="c"))


def test_without_a_keys_file_the_request_goes_unsigned() -> None:
    request = ReplayRequest(request_id="r-1")
    assert sign(request, ReplayerSettings()) == request


def test_only_our_event_or_our_dead_letter_is_the_answer() -> None:
    ours = ReplayRequest(request_id="r-1", reply_to="cli-ours")
    theirs = ReplayRequest(request_id="r-1", reply_to="cli-theirs")
    dead = [(HEADER_DLQ_REASON, b"unauthorised: unknown key id 'x'")]
    assert _answer(Record(b"not json"), "cli-ours", is_dead_letter=False) is None
    assert _answer(Record(b"not json"), "cli-ours", is_dead_letter=True) is None
    assert _answer(Record(theirs.model_dump_json().encode(), dead), "cli-ours", is_dead_letter=True) is None
    with pytest.raises(ServiceReplayError, match="refused the request: unauthorised: unknown key id 'x'"):
        _answer(Record(ours.model_dump_json().encode(), dead), "cli-ours", is_dead_letter=True)


def test_a_heartbeat_counts_only_for_its_own_group() -> None:
    beat = ReplayerHeartbeat(
        group_id="g1", lane="vllm", lane_fingerprint_sha256=SHA, at=datetime.now(UTC), interval_s=5.0
    )
    data = beat.model_dump_json().encode()
    assert _heartbeat(data, "g1") == beat
    assert _heartbeat(data, "g2") is None
    assert _heartbeat(b"{}", "g1") is None
    assert _heartbeat(None, "g1") is None


def _event(lane: str, fingerprint_sha256: str) -> DivergenceEvent:
    from tests.replayer.support import FakeLane, make_envelope

    envelope = make_envelope(1)
    lane_ = FakeLane()
    lane_.learn(envelope)
    event = replay_envelope(envelope, lane_, ReplayerSettings()).event
    return event.model_copy(update={"lane": lane, "lane_fingerprint_sha256": fingerprint_sha256})


def test_an_answer_from_any_advertised_lane_is_taken_and_a_forged_one_refused() -> None:
    """Issue 30: the service answers on the schedule lane it built for the request, which its heartbeat names
    beside its one-at-a-time lane; a fingerprint it does not name is a forged answer."""
    one, schedule, forged = "ab" * 32, "cd" * 32, "ef" * 32
    beat = ReplayerHeartbeat(
        group_id="g1", lane="vllm", lane_fingerprint_sha256=one, at=datetime.now(UTC), interval_s=5.0,
        lanes=(AdvertisedLane(name="vllm", fingerprint_sha256=one),
               AdvertisedLane(name="schedule", fingerprint_sha256=schedule)),
    )  # fmt: skip
    assert accept(beat, _event("schedule", schedule), None) is None
    assert accept(beat, _event("schedule", schedule), "schedule") is None
    assert accept(beat, _event("vllm", one), None) is None
    refused = accept(beat, _event("schedule", forged), None)
    assert refused is not None
    assert "efefefefefef…, which the running service does not advertise (vllm abab" in refused
    assert accept(beat, _event("schedule", schedule), "vllm") == "the answer is on lane schedule, not vllm"
    old = beat.model_copy(update={"lanes": None})  # a service that predates the field: its one lane only
    assert accept(old, _event("vllm", one), None) is None
    assert accept(old, _event("schedule", schedule), None) is not None


def test_a_heartbeat_without_lanes_keeps_its_identity() -> None:
    """``lanes`` is None when absent, and the canonical encoding leaves None out: the bytes of a heartbeat from
    before the field are unchanged (an empty tuple would add ``"lanes":[]``)."""
    beat = ReplayerHeartbeat(
        group_id="g1", lane="vllm", lane_fingerprint_sha256=SHA, at=datetime(2026, 1, 1, tzinfo=UTC), interval_s=5.0
    )
    assert canonical_bytes(beat) == (
        b'{"at":"2026-01-01T00:00:00Z","group_id":"g1","interval_s":5.0,"lane":"vllm","lane_fingerprint_sha256":"'
        + SHA.encode()
        + b'","schema_version":"reprolane.replay/1","stopping":false}'
    )
    assert decode_heartbeat(beat.model_dump_json()).lanes is None
