"""`infra.release.known_good.KnownGoodStore` on moto and, marked ``stack``, on the stack's SeaweedFS audit bucket:
write-once records, a deployment's history newest first, planted or moved records rejected, the last known-good
environment other than the failing candidate."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from infra.release.known_good import KnownGoodStore, last_known_good, rollback_lines
from schemas.layout import known_good_key
from tests.infra.release.known_good_support import MemoryHistory, record
from tests.replayer.support import BACKENDS, S3Target, s3_backend


@pytest.fixture(params=BACKENDS)
def s3(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    yield from s3_backend(request)


@pytest.fixture
def deployment() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


def test_records_are_written_once_and_listed_newest_first(s3: S3Target, deployment: str) -> None:
    store = KnownGoodStore(s3.client(), s3.bucket)
    old, new = record(deployment, minutes=0), record(deployment, minutes=10, dtype="float32")
    k_old, k_new = store.put(old), store.put(new)
    assert store.put(old) == k_old  # the same record again: the key holds its sha256, the write is refused as done
    found = store.history(deployment)
    assert found.records == (new, old)
    assert found.rejected == ()
    assert store.history(deployment, limit=1).records == (new,)
    assert k_new > k_old
    body = s3.client().get_object(Bucket=s3.bucket, Key=k_old)["Body"].read()
    assert body == old.canonical()


def test_a_planted_or_moved_record_is_rejected_never_a_target(s3: S3Target, deployment: str) -> None:
    store = KnownGoodStore(s3.client(), s3.bucket)
    good = record(deployment, minutes=0)
    store.put(good)
    # a record copied under a later key (to become "the newest"), and garbage under a well-formed key
    planted = record(deployment, minutes=1, dtype="float16")
    moved = known_good_key(deployment, planted.passed_at.replace(minute=30), planted.record_id())
    s3.client().put_object(Bucket=s3.bucket, Key=moved, Body=planted.canonical())
    junk = known_good_key(deployment, planted.passed_at.replace(minute=31), "0" * 64)
    s3.client().put_object(Bucket=s3.bucket, Key=junk, Body=b'{"schema_version": "x"}')
    found = store.history(deployment)
    assert found.records == (good,)
    assert {key for key, _ in found.rejected} == {moved, junk}
    assert last_known_good(store, deployment) == good


def test_last_known_good_skips_the_failing_candidate_and_other_deployments(deployment: str) -> None:
    history = MemoryHistory()
    first = record(deployment, minutes=0)
    second = record(deployment, minutes=5, dtype="float32")
    history.put(first)
    history.put(second)
    history.put(record("elsewhere", minutes=9, dtype="float16"))
    assert last_known_good(history, deployment) == second
    assert last_known_good(history, deployment, other_than=second.environment_sha256) == first
    assert last_known_good(history, "nobody") is None


def test_rollback_lines_name_the_image_model_and_engine_args(deployment: str) -> None:
    rec = record(deployment)
    text = "\n".join(rollback_lines(rec, deployment))
    assert rec.environment_sha256 in text
    assert "ghcr.io/acme/vllm@sha256:" + "ab" * 32 in text
    assert "--dtype bfloat16 --max-num-seqs 8" in text
    assert "no known-good environment recorded" in rollback_lines(None, deployment)[0]
