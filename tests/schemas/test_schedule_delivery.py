"""The schedule log's delivery contract (issue 22): segment names, the bounded reading of a segment's bytes, the
index entry, the envelope's reference and the external id vLLM derives from the forwarded X-Request-Id."""

from __future__ import annotations

import pytest

from schemas import ContractError
from schemas.canonical import canonical_bytes
from schemas.layout import schedule_index_key, schedule_segment_key
from schemas.schedule import RequestArrival
from schemas.schedule_delivery import (
    MAX_LINE_BYTES,
    MAX_SEGMENT_BYTES,
    ScheduleIndexEntry,
    ScheduleRef,
    decode_index_entry,
    decode_segment,
    external_request_id_for,
    is_key_safe_id,
    parse_segment_file_name,
    part_file_name,
    request_id_of,
    segment_file_name,
)
from tests import factories
from tests.schedule_segments import FakeEngine, encode


def _segment() -> tuple[FakeEngine, bytes]:
    engine = FakeEngine("eng-1")
    engine.request("chatcmpl-rl-aa")
    engine.request("chatcmpl-rl-bb", output_tokens=2)
    engine.run()
    return engine, encode(engine.take())


def test_a_recorders_segment_decodes_to_its_records() -> None:
    _, data = _segment()
    records = decode_segment(data, "eng-1")
    assert [r.kind for r in records][:3] == ["engine", "arrival", "arrival"]
    assert encode(records) == data
    assert decode_segment(b"", "eng-1") == ()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d[:-1], "not terminated"),
        (lambda d: d.replace(b'"eng-1"', b'"eng-2"', 1), "filed under"),
        (lambda d: b"\xff\xfe\n" + d, "line 1"),
        (lambda d: b'{"kind":"step"}\n' + d, "line 1"),
        (lambda d: b"[]\n" + d, "line 1"),
        (lambda d: d.replace(b"\n", b"\n\n", 1), "line 2"),
        (lambda d: d.replace(b'{"', b'{ "', 1), "canonical"),
        (lambda d: d + b" " * (MAX_LINE_BYTES + 1) + b"\n", "over"),
        (lambda d: d + b"\n" * (MAX_SEGMENT_BYTES + 1 - len(d)), "bound"),
    ],
)
def test_hostile_segments_are_refused_with_the_line(mutate: object, message: str) -> None:
    _, data = _segment()
    with pytest.raises(ContractError, match=message):
        decode_segment(mutate(data), "eng-1")  # type: ignore[operator]


def test_segment_names() -> None:
    assert segment_file_name(7) == "00000007.jsonl"
    assert parse_segment_file_name("00000007.jsonl") == 7
    assert part_file_name(7) == "00000007.jsonl.part"
    for other in ("00000007.jsonl.part", "7.jsonl", "00000007.json", "../00000007.jsonl", "00000007.jsonl\n"):
        assert parse_segment_file_name(other) is None
    assert schedule_segment_key("eng-1", 7) == "schedules/engine=eng-1/00000007.jsonl"


def test_external_ids_follow_vllms_openai_server() -> None:
    assert external_request_id_for("chat.completions", "rl-1") == "chatcmpl-rl-1"
    assert external_request_id_for("completions", "rl-1") == "cmpl-rl-1-0"
    with pytest.raises(ContractError):
        external_request_id_for("embeddings", "rl-1")
    assert is_key_safe_id("chatcmpl-rl-1-0a1b2c3d")
    assert not is_key_safe_id("../x")
    assert not is_key_safe_id("a/b")
    assert not is_key_safe_id("x" * 257)


def test_index_entry_round_trips_and_matches_only_its_arrival() -> None:
    arrival = RequestArrival(
        engine_id="eng-1", step=3, engine_request_id="chatcmpl-rl-aa-0a1b2c3d", external_request_id="chatcmpl-rl-aa",
        num_prompt_tokens=5,
    )  # fmt: skip
    entry = ScheduleIndexEntry(
        engine_id="eng-1", external_request_id="chatcmpl-rl-aa", engine_request_id="chatcmpl-rl-aa-0a1b2c3d",
        segment=2, segment_sha256="0" * 64, step=3,
    )  # fmt: skip
    assert decode_index_entry(entry.encode()) == entry
    assert entry.matches_arrival(arrival)
    assert not entry.matches_arrival(arrival.model_copy(update={"external_request_id": "chatcmpl-rl-bb"}))
    assert not entry.matches_arrival(arrival.model_copy(update={"step": 4}))
    with pytest.raises(ContractError):
        decode_index_entry(b"{" + b" " * 5000 + b"}")
    with pytest.raises(ContractError, match="request_id: String should match pattern"):
        decode_index_entry(entry.encode().replace(b"chatcmpl-rl-aa", b"../../x", 1))
    assert schedule_index_key("chatcmpl-rl-aa", "chatcmpl-rl-aa-0a1b2c3d") == (
        "index/schedule/chatcmpl-rl-aa/chatcmpl-rl-aa-0a1b2c3d.json"
    )


def test_schedule_ref_is_optional_and_keeps_old_envelope_ids() -> None:
    """An envelope without a schedule has the bytes (and id) it had before the field existed."""
    plain = factories.envelope()
    assert b'"schedule"' not in plain.canonical()
    assert plain.canonical() == canonical_bytes(plain)
    ref = ScheduleRef(external_request_id=f"chatcmpl-{plain.request_id}", recorder="vllm-scheduler")
    with_ref = plain.model_copy(update={"schedule": ref})
    assert with_ref.envelope_id() != plain.envelope_id()
    assert with_ref.canonical() == canonical_bytes(with_ref)


def test_an_external_id_names_its_captured_request_back() -> None:
    for endpoint in ("chat.completions", "completions"):
        assert request_id_of(external_request_id_for(endpoint, "rl-1")) == "rl-1"
    assert request_id_of("cmpl-rl-1-1") is None  # a completions request's second prompt: not choice 0
    assert request_id_of("resp-rl-1") is None  # not sent by the sidecar's way
    assert request_id_of("chatcmpl-") is None
