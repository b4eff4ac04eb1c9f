"""Index objects are written once on the real SeaweedFS (issue 18, finding 4): a second envelope claiming a
request id does not move the pointer; it is counted, its own envelope object is stored, and a redelivery of the
first is no conflict. Then the replayer's store follows the entry to the first envelope only.

Before the fix the second claimant overwrote ``index/request-id/<id>.json`` (the finding: two sidecars accepted
``loan-4711`` from tenants ``acme-bank`` and ``attacker``; ``replay request``, ``verify`` and ``hold add`` then
followed the index to the attacker's envelope).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from capture.metrics import CaptureMetrics
from capture.publishing.outgoing import Outgoing
from capture.publishing.publisher import Publisher
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from replayer.store import EnvelopeStore
from schemas import envelope_bytes
from schemas.layout import envelope_key, request_index_key
from tests.factories import envelope
from tests.replayer.support import S3Target

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]


class NoKafka:
    name = "kafka"
    refers_to_objects = True

    async def publish(self, batch: Sequence[Outgoing]) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest.fixture
async def spool(tmp_path: Path) -> AsyncIterator[Spool]:
    s = Spool(tmp_path / "spool", max_bytes=64 * 1024 * 1024)
    await s.open()
    yield s
    await s.close()


async def drained(spool: Spool) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while spool.depth:
        assert asyncio.get_running_loop().time() < deadline, f"{spool.depth} pending"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("s3_processes", [0, 1], ids=["s3-threads", "s3-processes"])
async def test_a_second_claimant_of_a_request_id_does_not_move_the_index(
    stack: StackInfo, spool: Spool, tmp_path: Path, s3_processes: int
) -> None:
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_region=stack.s3_region,
        s3_bucket=stack.audit_bucket,
    )
    request_id = f"loan-{uuid.uuid4().hex[:10]}"
    now = datetime.now(UTC)
    victim = envelope(request_id=request_id, tenant="acme-bank", captured_at=now, workflow=None)
    attacker = envelope(request_id=request_id, tenant="attacker", captured_at=now, workflow=None)
    metrics = CaptureMetrics()
    sink = S3Sink(settings, processes=s3_processes, metrics=metrics)
    publisher = Publisher(spool, settings, metrics, sinks=[NoKafka(), sink])
    await publisher.start()
    try:
        await spool.append(victim)
        await drained(spool)
        await spool.append(victim)  # a redelivery of the first: its own entry, no conflict
        await drained(spool)
        await spool.append(attacker)  # another batch, as from another sidecar
        await drained(spool)
    finally:
        await publisher.stop()
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    index = json.loads(client.get_object(Bucket=stack.audit_bucket, Key=request_index_key(request_id))["Body"].read())
    assert (index["envelope_id"], index["tenant"]) == (victim.envelope_id(), "acme-bank")
    assert metrics.value("reprolane_capture_index_conflicts_total") == 1
    key = envelope_key(attacker.envelope_id(), "attacker", now)
    assert envelope_bytes(client.get_object(Bucket=stack.audit_bucket, Key=key)["Body"].read()) == attacker.canonical()
    store = EnvelopeStore.from_settings(S3Target.from_stack(stack).settings())
    assert store.get_by_request_id(request_id) == victim
