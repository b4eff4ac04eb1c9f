"""Sealed envelopes (per-tenant encryption) verify by the id they carry; their contents are not opened."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from capture.audit.store import AuditStore
from capture.audit.verify import check_object
from schemas.layout import envelope_key
from schemas.sealed import seal_envelope
from tests.factories import envelope
from tests.moto_s3 import moto_server


@pytest.fixture(scope="module")
def store() -> Iterator[AuditStore]:
    with moto_server() as endpoint:
        client: Any = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="k",
            aws_secret_access_key="s",
        )
        bucket = f"sealed-{uuid.uuid4().hex[:8]}"
        client.create_bucket(Bucket=bucket)
        yield AuditStore(client, bucket)


def sealed_bytes(**overrides: Any) -> tuple[str, bytes]:
    env = envelope(**overrides)
    sealed = seal_envelope(
        env.canonical(),
        request_id=env.request_id,
        tenant=env.tenant,
        captured_at=env.captured_at,
        workflow=env.workflow,
        key_id="k1",
        data_key=os.urandom(32),
    )
    return envelope_key(env.envelope_id(), env.tenant, env.captured_at), sealed.canonical()


def test_a_sealed_object_is_checked_by_its_id(store: AuditStore) -> None:
    key, body = sealed_bytes(request_id="req-sealed-1")
    store.client.put_object(Bucket=store.bucket, Key=key, Body=body)
    finding = check_object(store, key)
    assert finding is not None
    assert finding.kind == "sealed"
    assert not finding.fatal


def test_a_sealed_object_under_another_id_is_modified(store: AuditStore) -> None:
    key, _ = sealed_bytes(request_id="req-sealed-2")
    _, other = sealed_bytes(request_id="req-sealed-3")
    store.client.put_object(Bucket=store.bucket, Key=key, Body=other)
    finding = check_object(store, key)
    assert finding is not None
    assert finding.kind == "modified"
    assert "sealed record in" in finding.message
    store.client.put_object(Bucket=store.bucket, Key=key, Body=other.replace(b'"k1"', b'"k1", "x": 1'))
    broken = check_object(store, key)
    assert broken is not None
    assert broken.kind == "modified"
