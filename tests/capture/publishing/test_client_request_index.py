"""The client's X-Request-Id, indexed per tenant (issue 18, finding 4): the capture sink writes one index object per
envelope, once (``IfNoneMatch``), under ``index/client-request-id/tenant=<t>/<client id>/``; the replayer's
store finds a tenant's envelopes only, refuses an index entry that points at another tenant's envelope, and
``reprolane replay request --client-request-id ID --tenant T`` replays the newest.

Against moto; ``stack``-marked twins run the same on the stack's SeaweedFS (its conditional PUT).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capture.publishing.outgoing import Outgoing
from capture.publishing.s3_sink import S3Sink
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from infra.cli.root import build_app
from replayer.cli import build_replay_app
from replayer.errors import EnvelopeNotFoundError, StoreError
from replayer.store import EnvelopeStore
from schemas import Envelope
from schemas.layout import client_request_index_key, index_body
from tests.factories import FIXED_TIME
from tests.replayer.support import BACKENDS, FakeLane, S3Target, make_envelope, s3_backend


@pytest.fixture(scope="module", params=BACKENDS)
def s3(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    yield from s3_backend(request)


def sink(s3: S3Target) -> S3Sink:
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=Path("unused"),
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        s3_bucket=s3.bucket,
        s3_region=s3.region,
        retention_days=0,
    )
    return S3Sink(settings)


async def publish(s3: S3Target, *envelopes: Envelope) -> None:
    s = sink(s3)
    try:
        await s.publish([Outgoing.from_entry(SpoolEntry(i, e.canonical())) for i, e in enumerate(envelopes)])
    finally:
        await s.close()


def client_id() -> str:
    return f"loan-{uuid.uuid4().hex[:8]}"


async def test_each_tenant_finds_its_own_envelopes_under_a_shared_client_id(s3: S3Target) -> None:
    cid = client_id()
    bank = make_envelope(1, tenant="acme-bank", client_request_id=cid)
    retry = make_envelope(2, tenant="acme-bank", client_request_id=cid, captured_at=FIXED_TIME + timedelta(seconds=1))
    attacker = make_envelope(3, tenant="attacker", client_request_id=cid)
    await publish(s3, attacker, retry, bank)
    store = EnvelopeStore.from_settings(s3.settings())
    assert store.find_by_client_request_id("acme-bank", cid) == [bank, retry]  # oldest first: retries are kept
    assert store.find_by_client_request_id("attacker", cid) == [attacker]
    with pytest.raises(EnvelopeNotFoundError):
        store.find_by_client_request_id("other", cid)
    with pytest.raises(EnvelopeNotFoundError):
        store.get_by_request_id(cid)  # the client id is never a request id


async def test_the_index_object_is_written_once_and_a_forged_one_is_refused_on_read(s3: S3Target) -> None:
    cid = client_id()
    bank = make_envelope(1, tenant="acme-bank", client_request_id=cid)
    attacker = make_envelope(2, tenant="attacker", client_request_id=cid)
    await publish(s3, attacker)
    # someone with PutObject writes the bank's index entry first, pointing at the attacker's envelope
    key = client_request_index_key("acme-bank", cid, bank.request_id)
    attacker_key = Outgoing.from_entry(SpoolEntry(0, attacker.canonical())).object_key
    forged = index_body(attacker.envelope_id(), attacker_key, "acme-bank", attacker.captured_at)
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=forged)
    await publish(s3, bank)  # 412 on the index: never overwritten (what is there is checked on read instead)
    assert s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read() == forged
    store = EnvelopeStore.from_settings(s3.settings())
    with pytest.raises(StoreError, match="does not match the envelope it points to: tenant 'attacker'"):
        store.find_by_client_request_id("acme-bank", cid)


async def test_replay_request_by_client_id_replays_the_tenants_newest(s3: S3Target) -> None:
    cid = client_id()
    first = make_envelope(1, tenant="acme-bank", client_request_id=cid)
    newest = make_envelope(2, tenant="acme-bank", client_request_id=cid, captured_at=FIXED_TIME + timedelta(hours=1))
    other = make_envelope(3, tenant="attacker", client_request_id=cid, captured_at=FIXED_TIME + timedelta(hours=2))
    await publish(s3, first, newest, other)
    lane = FakeLane()
    for env in (first, newest, other):
        lane.learn(env)
    app = build_app({"replay": build_replay_app(lane_factory=lambda _settings: lane)})
    s3_args = [
        "--s3-endpoint", s3.endpoint, "--s3-access-key", s3.access_key, "--s3-secret-key", s3.secret_key,
        "--s3-bucket", s3.bucket,
    ]  # fmt: skip
    runner = CliRunner()
    done = runner.invoke(app, ["replay", "request", "--client-request-id", cid, "--tenant", "acme-bank", *s3_args])
    assert done.exit_code == 0, done.output
    assert newest.request_id in done.stdout
    assert first.request_id not in done.stdout
    alone = runner.invoke(app, ["replay", "request", "--client-request-id", cid, *s3_args])
    both = runner.invoke(app, ["replay", "request", newest.request_id, "--client-request-id", cid, *s3_args])
    assert (alone.exit_code, both.exit_code) == (2, 2)
