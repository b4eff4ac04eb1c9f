"""The store trusts an index entry only when the envelope it points to agrees with it, and resolves claim checks
only to the exact referenced bytes (issue 18, findings 2 and 4).

Before: ``get_by_request_id("loan-4711")`` followed whatever the entry named, so an entry overwritten by a second
sidecar (or written by anyone with PutObject) sent ``replay request``, ``verify`` and ``hold add`` to another
tenant's envelope. Run against moto and, marked ``stack``, against the stack's SeaweedFS.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import pytest

from replayer.errors import StoreError
from replayer.store import EnvelopeStore
from schemas import ContractError
from schemas.claim_check import claim_check_for
from schemas.layout import envelope_key, index_body, request_index_key, workflow_index_key
from tests.replayer.support import BACKENDS, S3Target, make_envelope, s3_backend, seed_envelope


@pytest.fixture(scope="module", params=BACKENDS)
def s3(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    yield from s3_backend(request)


@pytest.fixture
def store(s3: S3Target) -> EnvelopeStore:
    return EnvelopeStore.from_settings(s3.settings())


def test_an_entry_filed_under_one_request_id_pointing_at_another_tenants_envelope_is_refused(
    s3: S3Target, store: EnvelopeStore
) -> None:
    """The finding's case: the entry for ``victim``'s request id names the attacker's envelope (and tenant)."""
    victim = make_envelope(1, tenant="acme-bank")
    attacker = make_envelope(2, tenant="attacker")
    seed_envelope(s3.client(), s3.bucket, attacker)
    key = envelope_key(attacker.envelope_id(), attacker.tenant, attacker.captured_at)
    body = index_body(attacker.envelope_id(), key, attacker.tenant, attacker.captured_at)
    s3.client().put_object(Bucket=s3.bucket, Key=request_index_key(victim.request_id), Body=body)
    with pytest.raises(StoreError, match=r"does not match the envelope it points to.*request id"):
        store.get_by_request_id(victim.request_id)


def test_an_entry_whose_tenant_or_envelope_id_disagrees_with_the_envelope_is_refused(
    s3: S3Target, store: EnvelopeStore
) -> None:
    env = make_envelope(3, tenant="acme-bank")
    key = seed_envelope(s3.client(), s3.bucket, env)
    relabelled = index_body(env.envelope_id(), key, "attacker", env.captured_at)
    s3.client().put_object(Bucket=s3.bucket, Key=request_index_key(env.request_id), Body=relabelled)
    with pytest.raises(StoreError, match="tenant 'acme-bank', the entry says 'attacker'"):
        store.get_by_request_id(env.request_id)
    wrong_id = index_body("0" * 64, key, env.tenant, env.captured_at)
    s3.client().put_object(Bucket=s3.bucket, Key=request_index_key(env.request_id), Body=wrong_id)
    with pytest.raises(StoreError, match="envelope id"):
        store.get_by_request_id(env.request_id)


def test_an_entry_without_a_tenant_is_malformed(s3: S3Target, store: EnvelopeStore) -> None:
    env = make_envelope(4)
    key = seed_envelope(s3.client(), s3.bucket, env)
    body = f'{{"envelope_id":"{env.envelope_id()}","key":"{key}"}}'.encode()
    s3.client().put_object(Bucket=s3.bucket, Key=request_index_key(env.request_id), Body=body)
    with pytest.raises(StoreError, match="malformed"):
        store.get_by_request_id(env.request_id)


def test_a_workflow_entry_filed_under_another_step_is_refused(s3: S3Target, store: EnvelopeStore) -> None:
    wf = f"wf-{uuid.uuid4().hex[:8]}"
    real = make_envelope(3, workflow=wf)
    key = seed_envelope(s3.client(), s3.bucket, real)
    body = index_body(real.envelope_id(), key, real.tenant, real.captured_at)
    s3.client().put_object(Bucket=s3.bucket, Key=workflow_index_key(wf, 9, real.request_id), Body=body)
    with pytest.raises(StoreError, match="workflow"):
        store.list_workflow(wf)


def test_a_claim_check_resolves_only_to_the_referenced_bytes(s3: S3Target, store: EnvelopeStore) -> None:
    env = make_envelope(5)
    key = seed_envelope(s3.client(), s3.bucket, env)
    ref = claim_check_for(env.envelope_id(), key, env.canonical())
    assert ref.sha256 == hashlib.sha256(env.canonical()).hexdigest()
    assert store.resolve_claim_check(ref.encode()) == env.canonical()
    lying = ref.model_copy(update={"sha256": "f" * 64})
    with pytest.raises(ContractError, match="sha256"):
        store.resolve_claim_check(lying.encode())
    other = make_envelope(6)
    missing = claim_check_for(
        other.envelope_id(), envelope_key(other.envelope_id(), other.tenant, other.captured_at), b""
    )
    with pytest.raises(StoreError, match="not there"):
        store.resolve_claim_check(missing.encode())
    elsewhere = ref.encode().replace(key.encode(), request_index_key(env.request_id).encode())
    with pytest.raises(ContractError, match="not an envelope object key"):
        store.resolve_claim_check(elsewhere)
