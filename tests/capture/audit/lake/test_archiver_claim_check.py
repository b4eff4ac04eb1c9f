"""The archiver resolves a claim check (an envelope too large for Kafka) from the audit bucket, checking size
and sha256, before it becomes a lake row (issue 18, finding 2). Unit tests on a local lake with a dict for the
audit bucket; the stack test publishes an envelope over the Kafka limit with the real publisher (Tansu +
SeaweedFS) and runs the real archiver over the topic."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from botocore.exceptions import ClientError

from capture.audit.errors import LakeError
from capture.audit.lake.archiver import Archiver
from capture.audit.lake.query import run_query
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from schemas import SamplingContract
from schemas.claim_check import claim_check_for
from schemas.layout import MAX_MESSAGE_BYTES, envelope_key
from tests.capture.audit.conftest import AuditStack
from tests.factories import envelope

SETTINGS = LakeSettings(flush_rows=3, flush_seconds=3600)


def reader(objects: dict[str, bytes]) -> Any:
    def read(key: str) -> bytes:
        if key not in objects:
            raise ClientError(
                {"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}, "GetObject"
            )
        return objects[key]

    return read


@pytest.fixture
def lake(tmp_path: Path) -> Lake:
    return Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")


async def test_a_claim_check_becomes_the_row_of_the_envelope_it_names(lake: Lake) -> None:
    env = envelope(request_id="big-1")
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    archiver = Archiver(SETTINGS, lake, read_audit=reader({key: env.canonical()}))
    value = archiver.resolve(claim_check_for(env.envelope_id(), key, env.canonical()).encode())
    assert value == env.canonical()
    assert archiver.add(SETTINGS.envelope_topic, value)
    await archiver.flush()
    assert run_query(lake, "SELECT request_id, envelope_id FROM envelopes").rows == [("big-1", env.envelope_id())]


def test_a_claim_check_that_does_not_match_is_skipped_and_a_missing_object_is_a_lake_error(lake: Lake) -> None:
    env = envelope(request_id="big-2")
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    archiver = Archiver(SETTINGS, lake, read_audit=reader({key: env.canonical() + b"tampered"}))
    ref = claim_check_for(env.envelope_id(), key, env.canonical()).encode()
    assert archiver.resolve(ref) == ref  # not resolved: add() skips it and counts it
    assert not archiver.add(SETTINGS.envelope_topic, ref)
    assert archiver.stats.skipped == 1
    with pytest.raises(LakeError, match="not there"):
        Archiver(SETTINGS, lake, read_audit=reader({})).resolve(ref)


@pytest.mark.stack
@pytest.mark.beside_engines
async def test_the_archiver_archives_an_envelope_over_the_kafka_limit(audit_stack: AuditStack, tmp_path: Path) -> None:
    info = audit_stack.info
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        kafka_bootstrap=info.kafka_bootstrap,
        s3_endpoint=info.s3_endpoint,
        s3_access_key=info.s3_access_key,
        s3_secret_key=info.s3_secret_key,
        s3_region=info.s3_region,
        s3_bucket=info.audit_bucket,
    )
    extra = {"junk": "\\" * (4 * 1024 * 1024 + 256)}
    sampling = SamplingContract(temperature=0.7, max_tokens=16, seed=1, seed_scope="per_request", extra=extra)
    large = envelope(request_id=f"big-{audit_stack.suffix}", captured_at=datetime.now(UTC), sampling=sampling)
    assert len(large.canonical()) > MAX_MESSAGE_BYTES
    spool = Spool(tmp_path / "spool", max_bytes=64 * 1024 * 1024)
    await spool.open()
    publisher = Publisher(
        spool, settings, sinks=[KafkaSink(settings, topic=audit_stack.envelope_topic), S3Sink(settings)]
    )
    await publisher.start()
    try:
        await spool.append(large)
        deadline = asyncio.get_running_loop().time() + 60
        while spool.depth:
            assert asyncio.get_running_loop().time() < deadline, "the large envelope was not published"
            await asyncio.sleep(0.1)
    finally:
        await publisher.stop()
        await spool.close()
    archiver = Archiver(audit_stack.lake_settings(), audit_stack.lake())
    stop = asyncio.Event()
    task = asyncio.create_task(archiver.run(stop))
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while archiver.stats.rows_written < 1 and not task.done():
            assert loop.time() < deadline, "the claim-checked envelope was not archived"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await task
    rows = run_query(audit_stack.lake(), "SELECT request_id, envelope_id FROM envelopes").rows
    assert rows == [(large.request_id, large.envelope_id())]
    assert archiver.stats.skipped == 0
