"""The schedule shipper against moto's S3 and an in-memory Kafka end (issue 22): every closed segment stored once
with its index entries and sent, deleted only after both; hostile segments quarantined without holding the rest
back; redeliveries collapse; failures leave the file in place. The real stack's version (SIGKILL mid-run, Tansu,
SeaweedFS) is test_shipper_stack.py."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capture.errors import CaptureError, RecordsRefused, SinkError
from capture.ledger.merkle_log import read_leaves
from capture.ledger.store import LedgerStore
from capture.schedule.destinations import SegmentStore
from capture.schedule.shipper import Shipper
from capture.schedule.shipper_settings import ShipperSettings
from schemas.layout import schedule_index_key, schedule_log, schedule_segment_key
from schemas.merkle import LeafEntry
from schemas.schedule_delivery import MAX_SEGMENT_BYTES, decode_index_entry, decode_segment
from schemas.schedule_proof import record_hashes, segment_leaf
from tests.moto_s3 import moto_client, moto_server
from tests.schedule_segments import FakeEngine, encode, write_segment


class FakeProducer:
    """The Kafka end, in memory: what was sent, what was dead-lettered; `fail` makes the next sends fail."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, bytes]] = []
        self.dead: list[tuple[str, int, str]] = []
        self.fail = 0
        self.refuse = False

    async def send(self, engine_id: str, seq: int, data: bytes, sha256: str) -> None:
        assert hashlib.sha256(data).hexdigest() == sha256
        if self.fail:
            self.fail -= 1
            raise SinkError("kafka down")
        if self.refuse:
            raise RecordsRefused("kafka", {seq: ("MessageSizeTooLargeError", "too large")})
        self.sent.append((engine_id, seq, data))

    async def dead_letter(self, engine_id: str, seq: int, payload: bytes, code: str, reason: str) -> bool:
        self.dead.append((engine_id, seq, code))
        return True

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    with moto_server() as endpoint:
        yield moto_client(endpoint)


@pytest.fixture
def bucket(s3: Any) -> str:
    name = f"sched-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def _shipper(s3: Any, bucket: str, tmp_path: Path) -> tuple[Shipper, FakeProducer]:
    settings = ShipperSettings(schedule_dir=tmp_path / "schedules", s3_bucket=bucket)
    producer = FakeProducer()
    store = SegmentStore(s3, bucket, retention=None)
    return Shipper(settings, store=store, producer=producer), producer  # type: ignore[arg-type]


def _stored(s3: Any, bucket: str, key: str) -> bytes | None:
    try:
        return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None


def _two_engines(directory: Path) -> dict[tuple[str, int], bytes]:
    """Two engines' logs, three segments: requests that span segments."""
    written: dict[tuple[str, int], bytes] = {}
    a, b = FakeEngine("eng-a"), FakeEngine("eng-b")
    a.request("chatcmpl-rl-1")
    a.step()
    written["eng-a", 0] = encode(a.take())
    a.request("chatcmpl-rl-2")
    a.run()
    written["eng-a", 1] = encode(a.take())
    b.request("cmpl-rl-3-0")
    b.run()
    written["eng-b", 0] = encode(b.take())
    for (engine, seq), data in written.items():
        write_segment(directory, engine, seq, data)
    return written


async def test_ships_every_segment_once_with_its_index_and_deletes_it(s3: Any, bucket: str, tmp_path: Path) -> None:
    shipper, producer = _shipper(s3, bucket, tmp_path)
    written = _two_engines(shipper.directory)
    (shipper.directory / "eng-a" / "00000002.jsonl.part").write_bytes(b"open")  # still being written: left alone
    assert await shipper.ship_pending() == 3
    for (engine, seq), data in written.items():
        assert _stored(s3, bucket, schedule_segment_key(engine, seq)) == data
    assert sorted((e, s) for e, s, _ in producer.sent) == sorted(written)
    assert [p.name for p in shipper.directory.rglob("*") if p.is_file()] == ["00000002.jsonl.part"]
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="index/schedule/")["Contents"]]
    assert len(keys) == 3
    entry = decode_index_entry(_stored(s3, bucket, keys[0]) or b"")
    assert entry.segment_sha256 == hashlib.sha256(written[entry.engine_id, entry.segment]).hexdigest()
    assert keys[0] == schedule_index_key(entry.external_request_id, entry.engine_request_id)
    assert shipper.shipped == 3
    registry = shipper.metrics.registry
    assert registry.get_sample_value("reprolane_shipper_segments_shipped_total") == 3
    assert registry.get_sample_value("reprolane_shipper_bytes_shipped_total") == sum(map(len, written.values()))
    assert registry.get_sample_value("reprolane_shipper_pending_segments") == 3  # at the scan, before shipping


def _logged(s3: Any, bucket: str, engine_id: str) -> list[LeafEntry]:
    return read_leaves(LedgerStore(s3, bucket), schedule_log(engine_id)).entries


async def test_every_segment_gets_one_leaf_in_its_engines_log_committing_to_its_shapes(
    s3: Any, bucket: str, tmp_path: Path
) -> None:
    shipper, producer = _shipper(s3, bucket, tmp_path)
    written = _two_engines(shipper.directory)
    producer.fail = 1  # Kafka down once, after the leaf was appended: the retry does not append it again
    with pytest.raises(SinkError):
        await shipper.ship_pending()
    await shipper.ship_pending()
    for engine in ("eng-a", "eng-b"):
        seqs = sorted(s for e, s in written if e == engine)
        expected = [
            segment_leaf(engine, seq, record_hashes(decode_segment(written[engine, seq], engine))) for seq in seqs
        ]
        assert _logged(s3, bucket, engine) == expected
    # what the leaf commits to: the shapes, ids blinded, not the bytes
    assert _logged(s3, bucket, "eng-b")[0].object_sha256 != hashlib.sha256(written["eng-b", 0]).hexdigest()


async def test_a_redelivery_collapses_onto_the_stored_segment(s3: Any, bucket: str, tmp_path: Path) -> None:
    """A crash after S3 and Kafka took a segment but before it was deleted: it is shipped again, harmlessly."""
    shipper, producer = _shipper(s3, bucket, tmp_path)
    written = _two_engines(shipper.directory)
    await shipper.ship_pending()
    write_segment(shipper.directory, "eng-a", 1, written["eng-a", 1])
    assert await shipper.ship_pending() == 1
    assert shipper.quarantined == 0
    assert shipper.store.index_conflicts == 0
    assert [(e, s) for e, s, _ in producer.sent].count(("eng-a", 1)) == 2  # at least once on Kafka
    assert len(_logged(s3, bucket, "eng-a")) == 2  # this process logged it once (a restarted one would add a
    # duplicate leaf, which verifiers take as harmless: the first counts)


async def test_hostile_segments_are_quarantined_and_the_rest_shipped(s3: Any, bucket: str, tmp_path: Path) -> None:
    shipper, producer = _shipper(s3, bucket, tmp_path)
    written = _two_engines(shipper.directory)
    bad = {
        1: b'{"kind":"step","engine_id":"eng-a"}\n',  # schema
        2: b"\xff" * 100 + b"\n",  # not UTF-8 JSON
        3: encode(FakeEngine("eng-other").take()),  # another engine's records filed here
    }
    for seq, data in bad.items():
        write_segment(shipper.directory, "eng-b", seq, data)
    with (shipper.directory / "eng-b" / "00000004.jsonl").open("wb") as fh:  # over the bound: never read whole
        fh.truncate(MAX_SEGMENT_BYTES + 1)
    target = tmp_path / "secret.jsonl"
    target.write_bytes(written["eng-b", 0])
    (shipper.directory / "eng-b" / "00000005.jsonl").symlink_to(target)
    (shipper.directory / "eng-b" / "README").write_text("not a segment")
    (shipper.directory / "eng-b" / "00000007.jsonl").mkdir()  # a directory under a segment's name
    write_segment(shipper.directory, "eng-b", 6, written["eng-b", 0])  # fine again after the bad ones
    assert await shipper.ship_pending() == 10
    assert shipper.quarantined == 6
    assert {(e, s) for e, s, _ in producer.sent} == {*written, ("eng-b", 6)}
    assert sorted(s for _, s, _ in producer.dead) == [1, 2, 3, 4, 5, 7]
    for seq in bad:
        assert _stored(s3, bucket, schedule_segment_key("eng-b", seq)) is None
    quarantined = sorted(p.name for p in shipper.settings.quarantine.joinpath("eng-b").iterdir())
    assert len([n for n in quarantined if n.endswith(".reason.json")]) == 6
    reasons = [json.loads(p.read_text()) for p in shipper.settings.quarantine.joinpath("eng-b").glob("*.reason.json")]
    assert {r["code"] for r in reasons} == {"InvalidSegment", "TooLarge", "NotAFile"}
    quarantined_metric = shipper.metrics.registry.get_sample_value
    assert quarantined_metric("reprolane_shipper_segments_quarantined_total", {"code": "InvalidSegment"}) == 3
    assert target.read_bytes() == written["eng-b", 0]  # the link's target was never read or moved
    assert (shipper.directory / "eng-b" / "README").exists()


async def test_a_key_holding_other_bytes_is_a_conflict_not_an_overwrite(s3: Any, bucket: str, tmp_path: Path) -> None:
    shipper, producer = _shipper(s3, bucket, tmp_path)
    written = _two_engines(shipper.directory)
    s3.put_object(Bucket=bucket, Key=schedule_segment_key("eng-a", 1), Body=b"forged\n")
    await shipper.ship_pending()
    assert _stored(s3, bucket, schedule_segment_key("eng-a", 1)) == b"forged\n"
    assert [s for _, s, c in producer.dead] == [1]
    assert {(e, s) for e, s, _ in producer.sent} == set(written) - {("eng-a", 1)}


async def test_a_forged_index_entry_is_kept_and_counted_never_replaced(s3: Any, bucket: str, tmp_path: Path) -> None:
    shipper, _ = _shipper(s3, bucket, tmp_path)
    engine = FakeEngine("eng-a")
    rid = engine.request("chatcmpl-rl-9")
    engine.run()
    write_segment(shipper.directory, "eng-a", 0, engine.take())
    key = schedule_index_key("chatcmpl-rl-9", rid)
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"forged":true}')
    await shipper.ship_pending()
    assert shipper.store.index_conflicts == 1
    assert _stored(s3, bucket, key) == b'{"forged":true}'
    assert shipper.shipped == 1


async def test_ids_that_cannot_be_keys_are_not_indexed(s3: Any, bucket: str, tmp_path: Path) -> None:
    shipper, _ = _shipper(s3, bucket, tmp_path)
    engine = FakeEngine("eng-a")
    engine.request("chatcmpl-../../etc")  # a client that called vLLM directly, with any X-Request-Id
    engine.request("chatcmpl-rl-ok")
    engine.run()
    write_segment(shipper.directory, "eng-a", 0, engine.take())
    await shipper.ship_pending()
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="index/")["Contents"]]
    assert len(keys) == 1
    assert keys[0].startswith("index/schedule/chatcmpl-rl-ok/")


async def test_failures_leave_the_segment_in_place(s3: Any, bucket: str, tmp_path: Path) -> None:
    shipper, producer = _shipper(s3, bucket, tmp_path)
    written = _two_engines(shipper.directory)
    producer.fail = 1
    with pytest.raises(SinkError):
        await shipper.ship_pending()
    assert (shipper.directory / "eng-a" / "00000000.jsonl").exists()
    assert await shipper.ship_pending() == 3
    assert {(e, s) for e, s, _ in producer.sent} == set(written)

    producer.refuse = True  # the broker refuses it for good: quarantined (S3 has it), the log goes on
    write_segment(shipper.directory, "eng-c", 0, encode(FakeEngine("eng-c").take()))
    assert await shipper.ship_pending() == 1
    assert shipper.quarantined == 1
    assert _stored(s3, bucket, schedule_segment_key("eng-c", 0)) is not None


async def test_one_shipper_per_directory(s3: Any, bucket: str, tmp_path: Path) -> None:
    first, _ = _shipper(s3, bucket, tmp_path)
    second, _ = _shipper(s3, bucket, tmp_path)
    _two_engines(first.directory)
    (first.directory / ".sync-tool").mkdir()  # hidden entries are nobody's engine, and never shipped
    first.hold()
    with pytest.raises(CaptureError, match="another process"):
        await second.ship_pending()
    assert await first.ship_pending() == 3
    await first.close()
    assert await second.ship_pending() == 0  # the lock passed on; nothing left to ship
    await second.close()
