"""The request-id index of a guaranteed stream points at its finished envelope, not at the started record that
came first (issue #18, finding 5); the started record stays stored as the evidence it was."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from schemas import Envelope
from schemas.layout import request_index_key, workflow_index_key
from tests.capture.support import CHAT, finished, sidecar
from tests.moto_s3 import moto_server

BUCKET = "reprolane-started-test"


@pytest.fixture(scope="module")
def moto_settings() -> Iterator[CaptureSettings]:
    with moto_server() as endpoint:
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s"
        ).create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
        yield CaptureSettings(
            upstream="http://127.0.0.1:9",
            spool_dir=Path("unused"),
            s3_endpoint=endpoint,
            s3_access_key="k",
            s3_secret_key="s",
            s3_bucket=BUCKET,
        )


async def a_guaranteed_stream(headers: dict[str, str] | None = None) -> tuple[Envelope, Envelope]:
    """The started record and the finished envelope the sidecar spools for one streamed request."""
    async with sidecar() as (client, _, spool, _m):
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers):
            pass
    done = finished(spool)
    return spool.envelopes[0], done


def s3_client(settings: CaptureSettings) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="k",
        aws_secret_access_key="s",
    )


def indexed(settings: CaptureSettings, key: str) -> str:
    body = s3_client(settings).get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return str(json.loads(body)["envelope_id"])


@pytest.mark.parametrize("batches", ["one batch", "two batches"])
async def test_the_index_points_at_the_finished_envelope(moto_settings: CaptureSettings, batches: str) -> None:
    started, done = await a_guaranteed_stream({"X-Reprolane-Workflow-Id": "wf-started", "X-Reprolane-Step": "3"})
    assert done.workflow is not None
    items = [Outgoing.from_entry(SpoolEntry(seq, env.canonical())) for seq, env in ((1, started), (2, done))]
    sink = S3Sink(moto_settings)
    try:
        if batches == "one batch":
            await sink.publish(items)
        else:  # the publisher sends batches in seq order, one after the other
            await sink.publish(items[:1])
            await sink.publish(items[1:])
    finally:
        await sink.close()
    assert indexed(moto_settings, request_index_key(done.request_id)) == done.envelope_id()
    assert indexed(moto_settings, workflow_index_key("wf-started", 3, done.request_id)) == done.envelope_id()
    s3 = s3_client(moto_settings)
    for item in items:  # both are stored: the started record is evidence too
        assert s3.head_object(Bucket=BUCKET, Key=item.object_key)["Metadata"]["envelope-id"] == item.envelope_id


async def test_a_started_record_no_finished_one_followed_is_stored_but_not_indexed(
    moto_settings: CaptureSettings,
) -> None:
    """The sidecar died serving the request: its started record is stored (Object Lock, found by its object key
    and in the Merkle log), and the write-once request-id entry is left for an envelope that says how a request
    ended, so a started record can never pin it."""
    started, _ = await a_guaranteed_stream()
    sink = S3Sink(moto_settings)
    item = Outgoing.from_entry(SpoolEntry(1, started.canonical()))
    assert item.started
    assert item.index_keys() == []
    try:
        await sink.publish([item])
    finally:
        await sink.close()
    s3 = s3_client(moto_settings)
    assert s3.head_object(Bucket=BUCKET, Key=item.object_key)["Metadata"]["envelope-id"] == started.envelope_id()
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix=request_index_key(started.request_id))
    assert listed.get("KeyCount", 0) == 0
