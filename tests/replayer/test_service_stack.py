"""ReplayerService against the real stack: Tansu (Kafka protocol) and SeaweedFS (S3, Object-Lock bucket).

Each test gets its own uuid topics and consumer group; the lane is a deterministic fake (no model), so what is
exercised is the consumer: selection, dead letters, commit-after-publish, crash recovery, on-demand requests.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from replayer.errors import StoreError
from replayer.service import ReplayerService
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayRequest
from schemas.layout import HEADER_DLQ_REASON, HEADER_DLQ_SOURCE
from tests.replayer.service_harness import Topics, Worker, events, results_by_request, wait_for_marker
from tests.replayer.support import (
    ArithmeticLane,
    S3Target,
    arithmetic_envelope,
    seed_envelope,
    signed,
    write_replay_request_keys,
)

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]  # a fake lane: no model; its own topics and groups


@pytest.fixture
async def topics(stack: Any) -> Topics:
    return await Topics.create(stack.kafka_bootstrap, S3Target.from_stack(stack))


async def test_envelopes_in_divergence_events_out_and_results_in_s3(topics: Topics) -> None:
    p = topics.suffix
    envs = [
        arithmetic_envelope(0, p),
        arithmetic_envelope(1, p, diverge_at=3),
        arithmetic_envelope(2, p, flagged=False),
        arithmetic_envelope(3, p),
    ]
    await topics.produce("envelope_topic", *(e.canonical() for e in envs))
    settings = topics.settings()
    store = EnvelopeStore.from_settings(settings)
    async with ReplayerService(settings, ArithmeticLane(), store) as service:
        got = events(await topics.consume("divergence_topic", 3))
    assert [(e.request_id, e.verdict) for e in got] == [
        (envs[0].request_id, "bitwise"), (envs[1].request_id, "diverged"), (envs[3].request_id, "bitwise")
    ]  # fmt: skip
    assert got[1].first_divergence is not None
    assert got[1].first_divergence.position == 3
    for env, ev in zip((envs[0], envs[1], envs[3]), got, strict=True):
        (key,) = store.list_results(env)
        assert key.endswith(f"/{ev.result_id()}.json")
    assert store.list_results(envs[2]) == []
    assert service.metrics.value("reprolane_replays_total", {"lane": "arith", "verdict": "bitwise"}) == 2
    assert service.metrics.value("reprolane_replayer_not_selected_total") == 1


async def test_poison_messages_are_dead_lettered_and_the_consumer_continues(topics: Topics) -> None:
    good = arithmetic_envelope(0, topics.suffix)
    schema_invalid = good.canonical().replace(b'"tenant":"acme-insurance"', b'"tenant":"no spaces allowed"')
    await topics.produce("envelope_topic", b"\x00\x01 definitely not json", schema_invalid, good.canonical())
    async with ReplayerService(topics.settings(), ArithmeticLane(), EnvelopeStore.from_settings(topics.settings())):
        got = events(await topics.consume("divergence_topic", 1))
        dead = await topics.consume("dead_letter_topic", 2)
    assert [e.request_id for e in got] == [good.request_id]
    assert [d.value for d in dead] == [b"\x00\x01 definitely not json", schema_invalid]
    headers = [dict(d.headers) for d in dead]
    assert headers[0][HEADER_DLQ_REASON].decode().startswith("undecodable: not JSON")
    assert headers[1][HEADER_DLQ_REASON].decode().startswith("schema: invalid envelope: tenant:")
    assert [h[HEADER_DLQ_SOURCE].decode() for h in headers] == [
        f"{topics.names['envelope_topic']}/0/0", f"{topics.names['envelope_topic']}/0/1"
    ]  # fmt: skip


async def test_on_demand_replay_request_echoes_reply_to(topics: Topics, tmp_path: Path) -> None:
    """A signed request is replayed; an unsigned one sent before it is dead-lettered as unauthorised."""
    env = arithmetic_envelope(0, topics.suffix, flagged=False)
    seed_envelope(topics.s3.client(), topics.s3.bucket, env)
    request = ReplayRequest(request_id=env.request_id, reply_to=f"ticket-{topics.suffix}")
    await topics.produce(
        "replay_request_topic", request.model_dump_json().encode(), signed(request).model_dump_json().encode()
    )
    settings = topics.settings(replay_request_keys_path=write_replay_request_keys(tmp_path / "keys.json"))
    async with ReplayerService(settings, ArithmeticLane(), EnvelopeStore.from_settings(settings)):
        (ev,) = events(await topics.consume("divergence_topic", 1))
        (dead,) = await topics.consume("dead_letter_topic", 1)
    assert (ev.request_id, ev.reply_to, ev.verdict) == (env.request_id, request.reply_to, "bitwise")
    assert dict(dead.headers)[HEADER_DLQ_REASON].decode().startswith("unauthorised: the request is not signed")


class FlakyStore(EnvelopeStore):
    """Fails the first lookup: the consumer must re-read the message, not skip it."""

    failed = False

    def get_result(self, envelope: Envelope, lane_fingerprint_sha256: str) -> Any:
        if not self.failed:
            self.failed = True
            raise StoreError("S3 get failed: simulated outage")
        return super().get_result(envelope, lane_fingerprint_sha256)


async def test_a_store_outage_rewinds_to_the_message(topics: Topics) -> None:
    envs = [arithmetic_envelope(n, topics.suffix) for n in range(2)]
    await topics.produce("envelope_topic", *(e.canonical() for e in envs))
    settings = topics.settings()
    plain = EnvelopeStore.from_settings(settings)
    async with ReplayerService(settings, ArithmeticLane(), FlakyStore(plain._client, plain.bucket)) as service:
        got = events(await topics.consume("divergence_topic", 2))
    assert [e.request_id for e in got] == [e.request_id for e in envs]
    assert service.metrics.value("reprolane_replayer_retries_total", {"error": "StoreError"}) == 1


async def test_a_replayer_killed_mid_replay_loses_nothing_and_counts_nothing_twice(
    topics: Topics, tmp_path: Path
) -> None:
    envs = [arithmetic_envelope(n, topics.suffix, diverge_at=2 if n == 3 else None) for n in range(5)]
    await topics.produce("envelope_topic", *(e.canonical() for e in envs))
    settings = topics.settings()
    worker = await Worker.start(settings, tmp_path, "replayer", hang_on=envs[2].request_id)
    try:
        await wait_for_marker([worker], timeout_s=60)
    finally:
        await worker.kill()
    assert worker.process.returncode == -signal.SIGKILL
    store = EnvelopeStore.from_settings(settings)
    assert len(store.list_results(envs[2])) == 1  # stored by the killed worker, never published
    first_run = events(await topics.consume("divergence_topic", 2, timeout_s=5))
    assert [e.request_id for e in first_run] == [e.request_id for e in envs[:2]]

    lane = ArithmeticLane()
    async with ReplayerService(settings, lane, store) as service:
        got = events(await topics.consume("divergence_topic", 5))
    by_request = results_by_request(got)
    assert sorted(by_request) == sorted(e.request_id for e in envs)  # nothing lost
    assert all(len(ids) == 1 for ids in by_request.values())  # a repeat carries the same result id
    for env in envs:
        assert len(store.list_results(env)) == 1  # exactly one stored result per envelope
    # the restarted replayer resumed at the uncommitted message; the stored result was re-published, not redone
    assert lane.calls == [tuple(e.prompt.token_ids) for e in envs[3:] if e.prompt]
    assert service.metrics.value("reprolane_replay_deduplicated_total") == 1
    assert sum(service.metrics.value("reprolane_replays_total", {"lane": "arith", "verdict": v})
               for v in ("bitwise", "diverged")) == 2  # fmt: skip
