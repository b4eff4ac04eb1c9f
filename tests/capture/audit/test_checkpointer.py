"""The scheduled checkpointer (moto S3): a log that grew is signed within the period, a rewritten one is refused
(logged, counted), and a round goes on past the refused day. The real-stack run is in test_evidence_stack.py."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from capture.audit.checkpoint import list_checkpoints
from capture.audit.checkpointer import Checkpointer
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import append_leaves
from schemas.layout import leaves_key, note_checkpoint_key
from schemas.merkle import LeafEntry
from tests.capture.audit.test_checkpoint import load_private_fresh
from tests.factories import envelope
from tests.moto_s3 import moto_client, moto_server

DAY, OTHER = "2026-11-29", "2026-11-30"
PERIOD = 0.2


@pytest.fixture(scope="module")
def moto_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def store(moto_endpoint: str) -> AuditStore:
    name = f"cpr-{uuid.uuid4().hex[:12]}"
    client = moto_client(moto_endpoint)
    client.create_bucket(Bucket=name)
    return AuditStore(client, name)


def leaves(n: int, tag: str) -> list[LeafEntry]:
    ids = [envelope(request_id=f"req-{tag}-{i}").envelope_id() for i in range(n)]
    return [LeafEntry(i, i) for i in ids]


def wait_for(condition: object, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(0.05)
    return False


def test_a_grown_log_is_signed_within_the_period(store: AuditStore) -> None:
    private = load_private_fresh()
    service = Checkpointer(store, private, key_name="test.example/audit", retention=None)
    append_leaves(store, DAY, leaves(2, "a"), None)
    thread = threading.Thread(target=service.run, args=(PERIOD,), daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: store.get(note_checkpoint_key(DAY, 2)) is not None, 10 * PERIOD + 5)
        append_leaves(store, DAY, leaves(3, "b"), None)  # the log grows: the next round signs size 5
        assert wait_for(lambda: store.get(note_checkpoint_key(DAY, 5)) is not None, 10 * PERIOD + 5)
    finally:
        service.stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert service.metrics.value("reprolane_checkpoints_signed_total") == 2
    assert service.metrics.value("reprolane_checkpointer_last_round_timestamp_seconds") > 0
    sizes = [c.tree_size for c in list_checkpoints(store, DAY)]
    assert sizes == [2, 5]  # each size once, however many rounds ran


def test_a_rewritten_log_is_refused_and_the_round_goes_on(store: AuditStore, caplog: pytest.LogCaptureFixture) -> None:
    private = load_private_fresh()
    service = Checkpointer(store, private, key_name="test.example/audit", retention=None)
    first = leaves(3, "c")
    append_leaves(store, DAY, first, None)
    assert [h.tree_size for h in service.run_round().signed] == [3]
    store.client.delete_object(Bucket=store.bucket, Key=leaves_key(DAY, 0))  # an attacker rewrites the day
    append_leaves(store, DAY, [first[1], first[0], first[2], *leaves(1, "d")], None)
    append_leaves(store, OTHER, leaves(2, "e"), None)  # another day grows meanwhile
    with caplog.at_level(logging.ERROR, logger="reprolane.checkpointer"):
        report = service.run_round()
    assert list(report.refused) == [DAY]
    assert "not consistent with checkpoint" in report.refused[DAY]
    assert [(h.key, h.tree_size) for h in report.signed] == [(note_checkpoint_key(OTHER, 2), 2)]
    assert service.metrics.value("reprolane_checkpoint_refusals_total", reason="inconsistent") == 1
    assert any("refused to sign" in r.getMessage() and DAY in r.getMessage() for r in caplog.records)
    assert [c.tree_size for c in list_checkpoints(store, DAY)] == [3]  # nothing signed over the rewrite
    assert service.run_round().refused.keys() == {DAY}  # and it stays refused


def test_a_torn_log_is_refused_as_broken(store: AuditStore) -> None:
    service = Checkpointer(store, load_private_fresh(), key_name="test.example/audit", retention=None)
    store.put_new(leaves_key(DAY, 0), b"\x01" * 40)
    assert service.run_round().refused.keys() == {DAY}
    assert service.metrics.value("reprolane_checkpoint_refusals_total", reason="broken") == 1
