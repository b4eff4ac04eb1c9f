"""An encrypted tenant's replay leaves no plaintext behind (issue 18, finding 7): the replayer seals the replay
result under the tenant's data key and publishes a divergence event without the fork's tokens.

Against FastStream's in-memory broker and a moto S3; the same on the real stack, through a shred, is in
tests/capture/audit/test_sealed_stack.py.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Iterator

import pytest
from faststream.kafka import TestKafkaBroker

from replayer.errors import NotReplayableError
from replayer.store import EnvelopeStore, result_key
from schemas import Envelope
from tests.replayer import support
from tests.replayer.support import S3Target, moto_s3
from tests.replayer.test_service import Harness, build, greedy

KEK = os.urandom(32)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Target]:
    with moto_s3() as target:
        yield target


def seed_sealed(s3: S3Target, env: Envelope) -> bytes:
    return support.seed_sealed(s3, env, KEK)


def encrypted_harness(s3: S3Target) -> Harness:
    return build(s3, kek=base64.b64encode(KEK).decode(), keys_bucket=s3.bucket)


def shred(s3: S3Target, tenant: str) -> None:
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=s3.bucket, Prefix=f"keys/tenant={tenant}/").get("Contents", []):
        client.delete_object(Bucket=s3.bucket, Key=obj["Key"])


async def test_an_encrypted_tenants_result_is_sealed_and_its_event_carries_no_token(s3: S3Target) -> None:
    h = encrypted_harness(s3)
    env = greedy(1, h.lane, diverge_at=1, tenant=f"enc-{uuid.uuid4().hex[:6]}")
    sealed = seed_sealed(s3, env)
    async with TestKafkaBroker(h.service.broker):
        await h.send(sealed, key=env.request_id.encode())
    [event] = h.events
    assert event.verdict == "diverged"
    fork = event.first_divergence
    assert fork is not None
    assert fork.position == 1
    assert (fork.at.recorded_top, fork.at.replayed_top) == ((), ())
    assert (fork.at.recorded_token_id, fork.at.replayed_token_id) == (None, None)
    assert fork.at.recorded_margin is not None  # the numbers stay: dashboards and the lake need them

    fp = h.service.lane_fingerprint_sha256
    stored = s3.client().get_object(Bucket=s3.bucket, Key=result_key(env, fp))["Body"].read()
    assert json.loads(stored)["schema_version"] == "reprolane.sealed-result/1"
    assert json.loads(stored)["tenant"] == env.tenant
    assert b"Paris" not in stored
    assert b"token_ids" not in stored
    # read back through the tenant's key: the whole result, fork tokens included
    result = h.service.store.get_result(env, fp)
    assert result is not None
    assert result.replayed.text.startswith("P")
    assert result.event.first_divergence is not None
    assert result.event.first_divergence.at.recorded_top

    # a redelivery publishes the same redacted event from the sealed result, without replaying
    async with TestKafkaBroker(h.service.broker):
        await h.send(sealed, key=env.request_id.encode())
    assert h.events[1] == event
    assert len(h.lane.calls) == 1

    shred(s3, env.tenant)
    with pytest.raises(NotReplayableError, match=r"crypto-shredded\): replay result [0-9a-f]{64} cannot be read"):
        EnvelopeStore(s3.client(), s3.bucket, keys_bucket=s3.bucket, kek=KEK).get_result(env, fp)


async def test_a_plain_tenants_result_and_event_are_unchanged(s3: S3Target) -> None:
    h = encrypted_harness(s3)
    env = greedy(2, h.lane, diverge_at=1)
    async with TestKafkaBroker(h.service.broker):
        await h.send(env.canonical(), key=env.request_id.encode())
    [event] = h.events
    assert event.first_divergence is not None
    assert event.first_divergence.at.recorded_top  # a plain tenant's event keeps its tokens
    stored = s3.client().get_object(Bucket=s3.bucket, Key=result_key(env, h.service.lane_fingerprint_sha256))
    assert json.loads(stored["Body"].read())["schema_version"] == "reprolane.replay/1"
