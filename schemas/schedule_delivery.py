"""How a schedule log travels and is found again: the envelope's reference, the index entry, the segment rules.

`schemas.schedule` says what an engine's schedule records are; this module says how they are delivered and joined
to envelopes (the recorder, the shipper and the replayer's reader each implement one side of it):

- **Segments.** The recorder (inside vLLM) writes ``<dir>/<engine_id>/<seq:08d>.jsonl.part`` (`part_file_name`)
  and renames it to ``<seq:08d>.jsonl`` once closed (fsynced): one `ScheduleRecord` per line (`encode_record`:
  canonical JSON, ``\\n``-terminated). `segment_file_name` / `parse_segment_file_name` spell those names; the
  recorder, the shipper, the lane's reader of its own log and the store all use them (and nothing else).
  `decode_segment` is the one reading of a segment's bytes, bounded (`MAX_SEGMENT_BYTES`, `MAX_LINE_BYTES`),
  every line schema-checked, canonical, and of the engine the segment is filed under: bytes from a disk, a
  bucket or a broker are hostile until this says otherwise.
- **The envelope's reference.** The sidecar forwards its own request id upstream as ``X-Request-Id``; vLLM's
  OpenAI server names the engine request ``chatcmpl-<X-Request-Id>`` (chat) or ``cmpl-<X-Request-Id>-<i>``
  (completions, prompt i): `external_request_id_for`. An envelope whose upstream records schedules carries a
  `ScheduleRef` with that external id (choice 0's: the first prompt), so the join never depends on anything a
  client chose.
- **The index.** For every `RequestArrival` the shipper writes one `ScheduleIndexEntry` under
  `schemas.layout.schedule_index_key` (external id, engine request id): which engine, which segment (and that
  segment's sha256), at which step. A reader trusts an entry only when the segment it names has that sha256 and
  holds that arrival (`ScheduleIndexEntry.matches_arrival`).

Pure: no IO.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal

from pydantic import Field, TypeAdapter, ValidationError

from schemas.base import Record, decode_record
from schemas.canonical import canonical_json
from schemas.errors import ContractError
from schemas.schedule import EngineId, RequestArrival, ScheduleRecord

SCHEDULE_INDEX_SCHEMA_VERSION: Final = "reprolane.schedule-index/1"

#: A closed segment larger than this is refused (the recorder closes one at about 4 MiB; a segment must also fit
#: one Kafka record with its headers: `schemas.layout.CLAIM_CHECK_BYTES`).
MAX_SEGMENT_BYTES: Final = 8 * 1024 * 1024 - 64 * 1024
#: One record (one line) longer than this is refused: a step of thousands of scheduled requests is a few hundred KB.
MAX_LINE_BYTES: Final = 1024 * 1024
#: An index entry is a few hundred bytes; a longer object under the index prefix is not one.
MAX_INDEX_ENTRY_BYTES: Final = 4096

_SEGMENT_NAME: Final = re.compile(r"([0-9]{8})\.jsonl")
_KEY_SAFE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,255}$")
_RECORDS: Final[TypeAdapter[ScheduleRecord]] = TypeAdapter(ScheduleRecord)
_ENGINE_ID: Final = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
#: An engine's or an external request id as it may appear in an S3 key (`is_key_safe_id`).
KeySafeId = Annotated[str, Field(pattern=_KEY_SAFE.pattern)]


class ScheduleRef(Record):
    """Where an envelope's schedule is: the engine's external id of the request, found through the index."""

    external_request_id: KeySafeId = Field(
        description="the engine request's external id as vLLM named it (chatcmpl-<request id>, cmpl-<request id>-0)"
    )
    recorder: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:\-]+$")] = Field(
        description="what recorded the schedule, as the sidecar's settings name it (e.g. vllm-scheduler)"
    )


class ScheduleIndexEntry(Record):
    """One request's arrival in an engine's schedule log: the join from an external request id to its records."""

    schema_version: Literal["reprolane.schedule-index/1"] = SCHEDULE_INDEX_SCHEMA_VERSION
    engine_id: EngineId
    external_request_id: KeySafeId
    engine_request_id: KeySafeId
    segment: int = Field(ge=0, description="seq of the segment holding the arrival")
    segment_sha256: Sha256
    step: int = Field(ge=0, description="the arrival's step")

    def encode(self) -> bytes:
        return canonical_json(self.model_dump(mode="json", exclude_none=True))

    def matches_arrival(self, arrival: RequestArrival) -> bool:
        """True when `arrival` is the record this entry says it indexes."""
        return (
            arrival.engine_id == self.engine_id
            and arrival.engine_request_id == self.engine_request_id
            and arrival.external_request_id == self.external_request_id
            and arrival.step == self.step
        )


def is_key_safe_id(value: str) -> bool:
    """An id that may be a segment of an S3 key: 1-256 of ``[A-Za-z0-9._:-]``, starting with a letter or digit
    (an engine request id from elsewhere, e.g. a client calling vLLM directly, may hold anything; such a request
    is simply not indexed: no envelope could name it)."""
    return _KEY_SAFE.fullmatch(value) is not None


def is_engine_id(value: str) -> bool:
    return _ENGINE_ID.fullmatch(value) is not None


#: vLLM's engine request id is the external id plus ``-`` and 8 random hex characters.
_ENGINE_SUFFIX_RE: Final = re.compile(r"-[0-9a-f]{8}$")
#: A request with ``n > 1`` runs as one engine request per choice, named ``<index>_<parent's engine id>`` (vLLM
#: 0.32's ``ParentRequest.get_child_info``).
_CHILD_PREFIX_RE: Final = re.compile(r"^([0-9]{1,3})_")


def external_request_id(engine_request_id: str) -> str:
    """The id the engine was given (``chatcmpl-<X-Request-Id>`` from the OpenAI server), without vLLM's suffix
    and without a choice's ``<index>_`` prefix: what an arrival is indexed under (every choice of a request with
    ``n > 1`` under its request's id)."""
    return _ENGINE_SUFFIX_RE.sub("", _CHILD_PREFIX_RE.sub("", engine_request_id, count=1))


def choice_index(engine_request_id: str) -> int:
    """The choice an engine request computes: ``i`` for vLLM's ``<i>_...`` child of a request with ``n > 1``, else
    0 (a request with ``n = 1`` is its own only choice)."""
    match = _CHILD_PREFIX_RE.match(engine_request_id)
    return int(match.group(1)) if match else 0


#: The external id vLLM's OpenAI server gives choice 0's engine request of a request sent with ``X-Request-Id: X``,
#: per endpoint: (prefix, suffix) around X (a completions request's first prompt is ``-0``).
_EXTERNAL_ID_FORMS: Final = {"chat.completions": ("chatcmpl-", ""), "completions": ("cmpl-", "-0")}


def external_request_id_for(endpoint: str, request_id: str) -> str:
    """The external id vLLM's OpenAI server gives the engine request of a captured request sent with
    ``X-Request-Id: <request_id>`` (choice 0's: a completions request's first prompt)."""
    form = _EXTERNAL_ID_FORMS.get(endpoint)
    if form is None:
        raise ContractError(f"no schedule id for endpoint {endpoint!r}")
    prefix, suffix = form
    return f"{prefix}{request_id}{suffix}"


def request_id_of(external_id: str) -> str | None:
    """The captured request id an external id names (`external_request_id_for` read backwards: choice 0's engine
    request of a chat request, or of a completions request's first prompt), None for any other id (a request sent
    to the engine without the sidecar's ``X-Request-Id``, or a completions request's later prompt)."""
    for prefix, suffix in _EXTERNAL_ID_FORMS.values():
        if external_id.startswith(prefix) and external_id.endswith(suffix):
            request_id = external_id.removeprefix(prefix).removesuffix(suffix)
            return request_id or None
    return None


def segment_file_name(seq: int) -> str:
    """A closed segment's file name (the recorder writes ``<name>.part`` first)."""
    return f"{seq:08d}.jsonl"


def part_file_name(seq: int) -> str:
    """The file name of a segment while the recorder writes it (never read: it may end mid-line)."""
    return f"{segment_file_name(seq)}.part"


def encode_record(record: ScheduleRecord) -> bytes:
    """One segment line: the record's canonical JSON (what `decode_segment` checks) and a newline."""
    return canonical_json(record.model_dump(mode="json", exclude_none=True)) + b"\n"


def parse_segment_file_name(name: str) -> int | None:
    """The seq a closed segment's file name holds; None for anything else (``.part`` files included)."""
    match = _SEGMENT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def decode_segment(data: bytes, engine_id: str) -> tuple[ScheduleRecord, ...]:
    """The records of one closed segment of `engine_id`, checked: at most `MAX_SEGMENT_BYTES`, UTF-8, every line
    ``\\n``-terminated, at most `MAX_LINE_BYTES`, a valid `ScheduleRecord` in canonical JSON, of `engine_id`.
    `ContractError` names the first line that is not."""
    if len(data) > MAX_SEGMENT_BYTES:
        raise ContractError(f"schedule segment: {len(data)} bytes, over the {MAX_SEGMENT_BYTES}-byte bound")
    if data and not data.endswith(b"\n"):
        raise ContractError("schedule segment: its last line is not terminated (a segment is closed whole)")
    return tuple(
        decode_record_line(line, f"schedule segment line {number}", engine_id)
        for number, line in enumerate(data.split(b"\n")[:-1], start=1)
    )


def decode_record_line(line: bytes, where: str, engine_id: str | None = None) -> ScheduleRecord:
    """One record line (without its ``\\n``), checked: at most `MAX_LINE_BYTES`, a valid `ScheduleRecord` in
    canonical JSON, of `engine_id` when given; `ContractError` starting with `where` when it is not."""
    if len(line) > MAX_LINE_BYTES:
        raise ContractError(f"{where}: {len(line)} bytes, over {MAX_LINE_BYTES}")
    try:
        record = _RECORDS.validate_json(line)
    except ValidationError as exc:
        raise ContractError.from_validation(where, exc) from exc
    if engine_id is not None and record.engine_id != engine_id:
        raise ContractError(f"{where}: engine {record.engine_id!r}, filed under {engine_id!r}")
    if canonical_json(record.model_dump(mode="json", exclude_none=True)) != line:
        raise ContractError(f"{where}: not in canonical JSON")
    return record


def decode_index_entry(data: bytes) -> ScheduleIndexEntry:
    """Parse an index object (bounded), `ContractError` naming the field."""
    if len(data) > MAX_INDEX_ENTRY_BYTES:
        raise ContractError(f"schedule index entry: {len(data)} bytes, over {MAX_INDEX_ENTRY_BYTES}")
    return decode_record(ScheduleIndexEntry, "schedule index entry", data)
