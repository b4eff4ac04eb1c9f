"""EnvelopeStore: lookups through the index, ordering, idempotent results, errors.

Written once, run twice: against moto (fast) and, marked ``stack``, against the stack's SeaweedFS (the real
Object-Lock audit bucket, where first-write-wins relies on its conditional PUT).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from replayer.errors import EnvelopeNotFoundError, StoreError
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore, result_key
from schemas import ReplayResult
from schemas.layout import request_index_key
from schemas.replay import DivergenceEvent, ReplayedOutput
from tests.replayer.support import BACKENDS, LANE_FINGERPRINT, S3Target, make_envelope, s3_backend, seed_envelope


@pytest.fixture(scope="module", params=BACKENDS)
def s3(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    yield from s3_backend(request)


@pytest.fixture
def store(s3: S3Target) -> EnvelopeStore:
    return EnvelopeStore.from_settings(s3.settings())


def replay_result(envelope_id: str, request_id: str, verdict: str = "bitwise", replay_ms: float = 1.0) -> ReplayResult:
    event = DivergenceEvent(
        request_id=request_id,
        envelope_id=envelope_id,
        lane="fake",
        lane_fingerprint=LANE_FINGERPRINT,
        lane_fingerprint_sha256=LANE_FINGERPRINT.sha256(),
        verdict=verdict,  # type: ignore[arg-type]
        levels_held=("bitwise", "token", "numeric"),
        target_level="token",
        target_met=True,
        token_match_rate=1.0,
        recorded_length=3,
        replayed_length=3,
        length_diff=0,
        cause_hint="identical",
        replayed_at=make_envelope(0).captured_at,
        replay_ms=replay_ms,
    )
    return ReplayResult(event=event, replayed=ReplayedOutput(token_ids=(1, 2, 3), text="abc"))


def test_get_by_request_id_follows_the_index(s3: S3Target, store: EnvelopeStore) -> None:
    env = make_envelope(1)
    seed_envelope(s3.client(), s3.bucket, env)
    assert store.get_by_request_id(env.request_id) == env


def test_unknown_and_invalid_request_ids_are_not_found(store: EnvelopeStore) -> None:
    with pytest.raises(EnvelopeNotFoundError, match="no envelope is indexed"):
        store.get_by_request_id(f"missing-{uuid.uuid4().hex}")
    with pytest.raises(EnvelopeNotFoundError, match="not a valid request id"):
        store.get_by_request_id("../etc/passwd")


def test_index_pointing_at_a_missing_envelope_is_not_found(s3: S3Target, store: EnvelopeStore) -> None:
    rid = f"dangling-{uuid.uuid4().hex[:8]}"
    s3.client().put_object(
        Bucket=s3.bucket, Key=request_index_key(rid), Body=b'{"envelope_id":"x","key":"nope","tenant":"t"}'
    )
    with pytest.raises(EnvelopeNotFoundError, match="missing"):
        store.get_by_request_id(rid)


def test_malformed_index_is_a_store_error(s3: S3Target, store: EnvelopeStore) -> None:
    rid = f"broken-{uuid.uuid4().hex[:8]}"
    s3.client().put_object(Bucket=s3.bucket, Key=request_index_key(rid), Body=b"not json")
    with pytest.raises(StoreError, match="malformed"):
        store.get_by_request_id(rid)


def test_list_workflow_is_ordered_by_step(s3: S3Target, store: EnvelopeStore) -> None:
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    envs = [make_envelope(n, workflow=wf) for n in (12, 3, 7)]
    for env in envs:
        seed_envelope(s3.client(), s3.bucket, env)
    got = store.list_workflow(wf)
    assert [e.workflow.step for e in got if e.workflow] == [3, 7, 12]
    with pytest.raises(EnvelopeNotFoundError):
        store.list_workflow(f"wf-{uuid.uuid4().hex[:8]}")


def test_a_workflow_id_another_tenant_also_sent_is_never_mixed(s3: S3Target, store: EnvelopeStore) -> None:
    """A workflow id is the client's label: an attacker's key can file steps under a victim's workflow id (the
    entries are written once, so it cannot replace them, only add to them). Replaying the workflow takes the named
    tenant's steps only, and without a tenant refuses to mix the two."""
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    victim = [make_envelope(n, workflow=wf, tenant="acme-bank") for n in (1, 2, 3)]
    intruder = [make_envelope(n, workflow=wf, tenant="attacker") for n in (2, 4)]
    for env in [*victim, *intruder]:
        seed_envelope(s3.client(), s3.bucket, env)
    with pytest.raises(StoreError, match="has steps of tenants acme-bank, attacker"):
        store.list_workflow(wf)
    got = store.list_workflow(wf, "acme-bank")
    assert [e.request_id for e in got] == [e.request_id for e in victim]
    assert [e.request_id for e in store.list_workflow(wf, "attacker")] == [e.request_id for e in intruder]
    with pytest.raises(EnvelopeNotFoundError):
        store.list_workflow(wf, "health")


def test_put_result_is_idempotent_first_write_wins(store: EnvelopeStore) -> None:
    env = make_envelope(2)
    fp = LANE_FINGERPRINT.sha256()
    assert store.get_result(env, fp) is None
    first = replay_result(env.envelope_id(), env.request_id, replay_ms=1.0)
    second = replay_result(env.envelope_id(), env.request_id, replay_ms=2.0)
    assert store.put_result(env, first) is True
    assert store.put_result(env, second) is False
    assert store.get_result(env, fp) == first
    assert store.list_results(env) == [result_key(env, fp)]


def test_result_key_ignores_replay_time_and_uses_capture_day() -> None:
    env = make_envelope(3)
    key = result_key(env, LANE_FINGERPRINT.sha256())
    assert key.startswith(f"replays/date={env.captured_at:%Y-%m-%d}/{env.envelope_id()}/")


def test_put_result_refuses_a_foreign_result(store: EnvelopeStore) -> None:
    env, other = make_envelope(4), make_envelope(5)
    with pytest.raises(ValueError, match="does not belong"):
        store.put_result(env, replay_result(other.envelope_id(), other.request_id))


def test_unreachable_endpoint_is_a_store_error() -> None:
    settings = ReplayerSettings(s3_endpoint="http://127.0.0.1:9", s3_access_key="k", s3_secret_key="s")
    store = EnvelopeStore.from_settings(settings)
    with pytest.raises(StoreError, match="failed"):
        store.get_by_request_id("req-1")


def test_missing_bucket_is_a_store_error(s3: S3Target) -> None:
    store = EnvelopeStore.from_settings(s3.settings(s3_bucket=f"nope-{uuid.uuid4().hex[:8]}"))
    with pytest.raises(StoreError, match="NoSuchBucket"):
        store.get_by_request_id("req-1")


def test_results_reads_every_lane_oldest_first_and_refuses_a_foreign_one(s3: S3Target, store: EnvelopeStore) -> None:
    env, other = make_envelope(6), make_envelope(7)
    assert store.results(env) == []
    first = replay_result(env.envelope_id(), env.request_id)
    later_fp = LANE_FINGERPRINT.model_copy(update={"dtype": "float32"})
    later = first.model_copy(
        update={
            "event": first.event.model_copy(
                update={
                    "lane_fingerprint": later_fp,
                    "lane_fingerprint_sha256": later_fp.sha256(),
                    "replayed_at": first.event.replayed_at.replace(year=first.event.replayed_at.year + 1),
                }
            )
        }
    )
    assert store.put_result(env, later)
    assert store.put_result(env, first)
    assert store.results(env) == [first, later]
    # a result of another envelope filed under this one (moved or forged) is refused, not shown as this one's
    foreign = replay_result(other.envelope_id(), other.request_id)
    key = result_key(env, "f" * 64)
    s3.client().put_object(Bucket=s3.bucket, Key=key, Body=foreign.model_dump_json().encode())
    with pytest.raises(StoreError, match=f"is of envelope {other.envelope_id()}"):
        store.results(env)
