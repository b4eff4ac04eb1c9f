"""The replayer resolves a claim check (an envelope too large for Kafka) from S3 before it replays it, and
dead-letters one that does not match its object (issue 18, finding 2). TestKafkaBroker and moto, as in
test_service.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faststream.kafka import TestKafkaBroker

from schemas.claim_check import claim_check_for
from schemas.layout import HEADER_DLQ_REASON
from tests.replayer.support import S3Target, moto_s3, seed_envelope
from tests.replayer.test_service import build, greedy


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Target]:
    with moto_s3() as target:
        yield target


async def test_a_claim_check_is_replayed_as_the_envelope_it_names(s3: S3Target) -> None:
    h = build(s3)
    env = greedy(1, h.lane)
    key = seed_envelope(s3.client(), s3.bucket, env)
    async with TestKafkaBroker(h.service.broker):
        await h.send(claim_check_for(env.envelope_id(), key, env.canonical()).encode(), key=env.request_id.encode())
    assert [(e.envelope_id, e.verdict) for e in h.events] == [(env.envelope_id(), "bitwise")]
    assert h.dead == []


async def test_a_claim_check_that_does_not_match_its_object_is_dead_lettered(s3: S3Target) -> None:
    h = build(s3)
    env = greedy(2, h.lane)
    key = seed_envelope(s3.client(), s3.bucket, env)
    lying = claim_check_for(env.envelope_id(), key, env.canonical() + b" ")
    async with TestKafkaBroker(h.service.broker):
        await h.send(lying.encode())
    assert h.events == []
    ((_, headers),) = h.dead
    assert headers[HEADER_DLQ_REASON].startswith("claim_check:")
    assert h.metrics.value("reprolane_replayer_dead_letters_total", {"reason": "claim_check"}) == 1
