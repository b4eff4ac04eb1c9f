"""Envelopes and replay results in S3: lookup by request id or workflow, idempotent result writes.

The capture side writes each envelope once under `schemas.layout.envelope_key` and an index object per request
id (and per workflow step), written once, whose body is `schemas.layout.index_body` (envelope id, key, tenant,
capture time). This module reads those, trusting an entry only when the envelope it points to has the entry's
tenant and envelope id and the request id (or workflow step) the entry is filed under, and
writes replay results under `schemas.layout.replay_key` with the envelope's capture day, so the key is a pure
function of (envelope id, lane fingerprint): the first write wins (``If-None-Match: *``) and every later
re-replay of the same envelope on the same lane collapses onto it.

Sealed envelopes (encrypted tenants, `schemas.sealed`): an object that holds a `SealedEnvelope` is opened with
the tenant's data key, read from ``keys/tenant=T/<key_id>.json`` in the keys bucket and unwrapped with the
configured KEK. When that key no longer exists (crypto-shredded) the envelope raises `NotReplayableError`.
The store remembers, for the envelopes it opened (a bounded map), the tenant's key id and data key: the replay
result of such an envelope is written sealed under the same key (`schemas.sealed.SealedReplayResult`) and read
back through it, and `is_encrypted` tells the service to publish a redacted divergence event. A shred of the
tenant then leaves neither its envelopes nor its replayed text readable in S3.

boto3 is synchronous: async callers run these methods in a worker thread (``asyncio.to_thread``). Every
botocore error is translated here into `StoreError` (or `EnvelopeNotFoundError` for a missing index), so no
caller ever sees a raw backend exception.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, NamedTuple

from botocore.exceptions import BotoCoreError

from infra.clients.s3 import S3Policy, is_already_written, is_missing, make_s3_client, s3_call
from replayer.errors import EnvelopeNotFoundError, NotReplayableError, StoreError
from replayer.settings import ReplayerSettings
from schemas import ContractError, Envelope, ReplayResult, decode_envelope, decode_replay_result, envelope_bytes
from schemas.canonical import sha256_hex
from schemas.claim_check import decode_claim_check, verify_claimed
from schemas.envelope import is_valid_request_id
from schemas.errors import SealError
from schemas.index_entry import IndexEntry, RecordFacts, filed_step, index_mismatch, parse_index_entry, record_facts
from schemas.layout import (
    client_request_index_prefix,
    data_key_key,
    is_envelope_key,
    replay_key,
    replay_results_prefix,
    request_index_key,
    shadow_index_prefix,
    tenant_envelopes_prefix,
    workflow_index_prefix,
)
from schemas.replay import replay_result_id
from schemas.sealed import (
    SealedEnvelope,
    decode_sealed,
    decode_sealed_result,
    decode_wrapped_key,
    is_sealed,
    is_sealed_result,
    open_envelope,
    open_replay_result,
    parse_kek,
    seal_replay_result,
    unwrap_key,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

#: How many opened envelopes' data keys the store keeps for sealing their results (a replay needs one at a time).
SEALING_KEYS_KEPT = 4096


class _TenantKey(NamedTuple):
    tenant: str
    key_id: str
    data_key: bytes


@dataclass(frozen=True)
class StoredRecord:
    """One envelope object as S3 holds it: its key, the bytes written (canonical JSON, a compact record or a sealed
    one), their content address (the envelope id, checked), and the envelope they hold: None when it is sealed and
    cannot be opened here, `unopened` saying why."""

    key: str
    data: bytes
    envelope_id: str
    envelope: Envelope | None
    sealed: SealedEnvelope | None = None
    unopened: str | None = None

    @property
    def canonical(self) -> bytes | None:
        """The canonical JSON this record holds, whose sha256 is the envelope id: the stored bytes as the one
        reader decodes them (`schemas.envelope_bytes`: a compact record decoded, JSON as it is), or, for a sealed
        record that was opened, its envelope's canonical encoding; None when it is sealed and was not opened."""
        if self.envelope is None:
            return None
        if self.sealed is not None:
            return self.envelope.canonical()
        return envelope_bytes(self.data)

    @property
    def _routing(self) -> Envelope | SealedEnvelope:
        routing = self.envelope if self.envelope is not None else self.sealed
        assert routing is not None, "a stored record holds an envelope or a sealed one"
        return routing

    @property
    def tenant(self) -> str:
        return self._routing.tenant

    @property
    def request_id(self) -> str:
        return self._routing.request_id

    @property
    def captured_at(self) -> datetime:
        return self._routing.captured_at


def result_key(envelope: Envelope, lane_fingerprint_sha256: str) -> str:
    """Where the result of replaying `envelope` on the lane with that fingerprint lives (deterministic)."""
    envelope_id = envelope.envelope_id()
    return replay_key(envelope_id, replay_result_id(envelope_id, lane_fingerprint_sha256), envelope.captured_at)


class EnvelopeStore:
    """Read envelopes and read/write replay results in one bucket (blocking; see module docstring)."""

    def __init__(self, client: S3Client, bucket: str, *, keys_bucket: str | None = None, kek: bytes | None = None):
        self._client = client
        self.bucket = bucket
        self.keys_bucket = keys_bucket
        self._kek = kek
        self._sealing: OrderedDict[str, _TenantKey] = OrderedDict()  # envelope id -> its tenant's key

    @classmethod
    def from_settings(cls, settings: ReplayerSettings) -> EnvelopeStore:
        try:
            kek_text = settings.kek.get_secret_value() if settings.kek is not None else None
            if kek_text is None and settings.kek_file is not None:
                kek_text = settings.kek_file.read_text()
            kek = parse_kek(kek_text) if kek_text is not None else None
            return cls(
                make_s3_client(settings, policy=S3Policy.REPLAYER),
                settings.s3_bucket,
                keys_bucket=settings.keys_bucket,
                kek=kek,
            )
        except (BotoCoreError, ValueError, OSError) as exc:
            raise StoreError(f"cannot configure the envelope store: {exc}") from exc

    # -- raw objects -----------------------------------------------------------------------------------------

    def _get(self, key: str, bucket: str | None = None) -> bytes | None:
        """The object's bytes, or None when there is no such key."""
        bucket = bucket or self.bucket
        return s3_call(
            "get",
            f"s3://{bucket}/{key}",
            lambda: self._client.get_object(Bucket=bucket, Key=key)["Body"].read(),
            none_if=is_missing,
            error=StoreError,
        )

    def _list(self, prefix: str) -> list[str]:
        def keys() -> list[str]:
            found: list[str] = []
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                found.extend(obj["Key"] for obj in page.get("Contents", []) if "Key" in obj)
            return found

        return sorted(
            s3_call("list", f"s3://{self.bucket}/{prefix}", keys, none_if=lambda _: False, error=StoreError) or []
        )

    def _indexed(self, index_key: str, what: str) -> tuple[IndexEntry, bytes]:
        """The index entry filed at `index_key` and the stored bytes of the object it points at, both unchecked."""
        body = self._get(index_key)
        if body is None:
            raise EnvelopeNotFoundError(f"no envelope is indexed under {what}")
        try:
            entry = parse_index_entry(body, f"s3://{self.bucket}/{index_key}")
        except ContractError as exc:
            raise StoreError(str(exc)) from exc
        data = self._get(entry.key)
        if data is None:
            raise EnvelopeNotFoundError(f"{what} is indexed at {entry.key}, but that object is missing (shredded?)")
        return entry, data

    def _envelope_from_index(
        self, index_key: str, what: str, *, request_id: str | None = None, workflow: tuple[str, int] | None = None
    ) -> Envelope:
        """The envelope an index entry points at, checked against the entry (`_check_index`)."""
        entry, data = self._indexed(index_key, what)
        envelope = self.decode(data, f"s3://{self.bucket}/{entry.key}")
        self._check_index(index_key, entry, RecordFacts.of_envelope(envelope), request_id, workflow)
        return envelope

    def _record_from_index(self, index_key: str, what: str, *, request_id: str | None = None) -> StoredRecord:
        """The object an index entry points at as it is stored (`StoredRecord`), its bytes checked against their
        content address, and the envelope in it checked against the entry; a sealed one whose key is gone (or
        that no KEK opens here) is returned unopened, with the reason."""
        entry, data = self._indexed(index_key, what)
        key, envelope_id, where = entry.key, entry.envelope_id, f"s3://{self.bucket}/{entry.key}"
        if not is_sealed(data):
            try:
                address = sha256_hex(envelope_bytes(data))  # a compact envelope: of the canonical bytes it holds
            except ContractError as exc:
                raise StoreError(f"stored envelope {where} does not decode: {exc}") from exc
            if address != envelope_id:
                raise StoreError(f"stored envelope {where}: its bytes hash to {address}, not to the "
                                 f"envelope id {envelope_id} it is filed under (altered?)")  # fmt: skip
            envelope = self.decode(data, where)
            self._check_index(index_key, entry, RecordFacts.of_envelope(envelope), request_id, None)
            return StoredRecord(key, data, envelope_id, envelope)
        try:
            sealed = decode_sealed(data)
        except ContractError as exc:
            raise StoreError(f"stored sealed envelope {where} does not decode: {exc}") from exc
        self._check_index(index_key, entry, record_facts(data), request_id, None)  # its clear metadata
        try:
            envelope = self.decode(data, where)  # opening checks the plaintext against the envelope id
        except NotReplayableError as exc:
            return StoredRecord(key, data, envelope_id, None, sealed, str(exc))
        self._check_index(index_key, entry, RecordFacts.of_envelope(envelope), request_id, None)
        return StoredRecord(key, data, envelope_id, envelope, sealed)

    def _check_index(
        self,
        index_key: str,
        entry: IndexEntry,
        facts: RecordFacts,
        request_id: str | None,
        workflow: tuple[str, int] | None,
    ) -> None:
        """An index entry is trusted only when the record it points at agrees with it (`schemas.index_entry`:
        the same tenant and envelope id, the request id and workflow step it is filed under). Anything else is a
        `StoreError`: an entry written by someone other than the capture side, or one moved to another record."""
        found = index_mismatch(entry, facts, request_id=request_id, workflow=workflow)
        if found:
            raise StoreError(
                f"index object s3://{self.bucket}/{index_key} does not match the envelope it points to: "
                + "; ".join(found)
            )

    def resolve_claim_check(self, reference: bytes) -> bytes:
        """The envelope bytes a claim check (`schemas.claim_check`, an envelope too large for Kafka) names, read
        from S3 and checked against the reference's size and sha256: `ContractError` when the reference is bad or
        the object is not the referenced bytes, `StoreError` when S3 fails or the object is not there (yet)."""
        ref = decode_claim_check(reference)
        data = self._get(ref.key)
        if data is None:
            raise StoreError(f"claim check names s3://{self.bucket}/{ref.key}, which is not there")
        return verify_claimed(ref, data)

    def decode(self, data: bytes, where: str) -> Envelope:
        """An envelope from stored bytes, opening a sealed one with its tenant's data key."""
        try:
            return self.decode_message(data, where)
        except ContractError as exc:
            raise StoreError(f"stored envelope {where} does not decode: {exc}") from exc

    def decode_message(self, data: bytes, where: str = "from the envelope topic") -> Envelope:
        """An envelope from consumed bytes, plain or sealed: `ContractError` when they are not one (or a sealed
        one does not open), `NotReplayableError` when its key is gone or no KEK is configured, `StoreError` when
        S3 fails while fetching the key."""
        if is_sealed(data):
            data = self._open_sealed(data, where)
        return decode_envelope(data)

    def _open_sealed(self, data: bytes, where: str) -> bytes:
        sealed = decode_sealed(data)
        what = f"envelope {where} is sealed (tenant {sealed.tenant} is encrypted)"
        gone = f"request {sealed.request_id} cannot be replayed"
        try:
            data_key = self._data_key(sealed.tenant, sealed.key_id, what, gone)
            plaintext = open_envelope(sealed, data_key)
        except SealError as exc:
            raise ContractError(f"sealed envelope {where} does not open: {exc}") from exc
        self._sealing[sealed.envelope_id] = _TenantKey(sealed.tenant, sealed.key_id, data_key)
        self._sealing.move_to_end(sealed.envelope_id)
        while len(self._sealing) > SEALING_KEYS_KEPT:
            self._sealing.popitem(last=False)
        return plaintext

    def _data_key(self, tenant: str, key_id: str, what: str, gone: str) -> bytes:
        """The tenant's unwrapped data key `key_id`; `NotReplayableError` without a KEK or once it is shredded,
        `SealError` when it does not unwrap."""
        if self._kek is None or self.keys_bucket is None:
            raise NotReplayableError(
                f"{what} and no KEK is configured (REPROLANE_REPLAYER_KEK or REPROLANE_REPLAYER_KEK_FILE)"
            )
        wrapped = self._get(data_key_key(tenant, key_id), self.keys_bucket)
        if wrapped is None:
            raise NotReplayableError(f"tenant {tenant}'s data key was destroyed (crypto-shredded): {gone}")
        return unwrap_key(decode_wrapped_key(wrapped), self._kek)

    def is_encrypted(self, envelope: Envelope) -> bool:
        """True when `envelope` came sealed (its tenant is encrypted): what is derived from it is sealed too."""
        return envelope.envelope_id() in self._sealing

    # -- envelopes -------------------------------------------------------------------------------------------

    def get_by_request_id(self, request_id: str) -> Envelope:
        """The envelope recorded for `request_id`; `EnvelopeNotFoundError` when none is indexed."""
        if not is_valid_request_id(request_id):
            raise EnvelopeNotFoundError(f"{request_id!r} is not a valid request id")
        return self._envelope_from_index(
            request_index_key(request_id), f"request id {request_id!r}", request_id=request_id
        )

    def read_record(self, request_id: str) -> StoredRecord:
        """The envelope recorded for `request_id` exactly as stored (see `_record_from_index`)."""
        if not is_valid_request_id(request_id):
            raise EnvelopeNotFoundError(f"{request_id!r} is not a valid request id")
        return self._record_from_index(
            request_index_key(request_id), f"request id {request_id!r}", request_id=request_id
        )

    def read_client_records(self, tenant: str, client_request_id: str) -> list[StoredRecord]:
        """What `find_by_client_request_id` finds, as stored (sealed ones unopened without their key), oldest
        first; an opened envelope of another tenant or client id is a `StoreError`."""
        if not is_valid_request_id(tenant) or not is_valid_request_id(client_request_id):
            raise EnvelopeNotFoundError(f"{tenant!r} / {client_request_id!r} is not a valid tenant / client id")
        what = f"client request id {client_request_id!r} of tenant {tenant!r}"
        keys = self._list(client_request_index_prefix(tenant, client_request_id))
        if not keys:
            raise EnvelopeNotFoundError(f"no envelope is indexed under {what}")
        records = [self._record_from_index(key, f"{what} ({key})") for key in keys]
        for rec, key in zip(records, keys, strict=True):
            client_id = rec.envelope.client_request_id if rec.envelope is not None else client_request_id
            if rec.tenant != tenant or client_id != client_request_id:
                raise StoreError(f"index object s3://{self.bucket}/{key} points at an envelope of tenant "
                                 f"{rec.tenant!r}, client id {client_id!r}: not {what}")  # fmt: skip
        return sorted(records, key=lambda r: r.captured_at)

    def list_workflow(self, workflow_id: str, tenant: str | None = None) -> list[Envelope]:
        """Every recorded step of a workflow, ordered by step; `EnvelopeNotFoundError` when there is none.

        A workflow id is the client's label, not an identity: any caller may send the same one. So the steps are
        `tenant`'s only; without a tenant, steps of more than one tenant are a `StoreError` naming them (another
        tenant's steps are never mixed into a workflow's replay silently).
        """
        if not is_valid_request_id(workflow_id):
            raise EnvelopeNotFoundError(f"{workflow_id!r} is not a valid workflow id")
        what = f"workflow {workflow_id!r}" + ("" if tenant is None else f" of tenant {tenant!r}")
        keys = self._list(workflow_index_prefix(workflow_id))
        envelopes = [
            self._envelope_from_index(key, f"workflow {workflow_id!r} ({key})", workflow=filed_step(workflow_id, key))
            for key in keys
        ]
        tenants = sorted({e.tenant for e in envelopes})
        if tenant is not None:
            envelopes = [e for e in envelopes if e.tenant == tenant]
        elif len(tenants) > 1:
            raise StoreError(f"{what} has steps of tenants {', '.join(tenants)}: name the tenant (--tenant)")
        if not envelopes:
            raise EnvelopeNotFoundError(f"no envelope is indexed under {what}")
        return sorted(envelopes, key=lambda e: (e.workflow.step if e.workflow else -1, e.captured_at))

    def find_by_client_request_id(self, tenant: str, client_request_id: str) -> list[Envelope]:
        """The envelopes `tenant`'s client sent as ``X-Request-Id: client_request_id`` (a retry is one more),
        oldest first; only those whose stored tenant and client id are these (an index entry pointing
        elsewhere is refused as a `StoreError`); `EnvelopeNotFoundError` when there is none, `NotReplayableError`
        when one is sealed and cannot be opened here."""
        envelopes = []
        for record in self.read_client_records(tenant, client_request_id):
            if record.envelope is None:
                raise NotReplayableError(record.unopened or f"request {record.request_id} is sealed")
            envelopes.append(record.envelope)
        return envelopes

    def shadow_index(self, day: str) -> list[tuple[str, str, str]]:
        """The shadow index entries of capture day `day` (``YYYY-MM-DD``): (index key, request id, captured_at as
        the entry says it), for `replayer.gate.shadow` to window by time before reading any envelope."""
        prefix = shadow_index_prefix(day)
        found: list[tuple[str, str, str]] = []
        for key in self._list(prefix):
            body = self._get(key)
            try:
                captured = json.loads(body or b"")["captured_at"]
                if not isinstance(captured, str):
                    raise TypeError("captured_at must be a string")
            except (ValueError, KeyError, TypeError) as exc:
                raise StoreError(f"index object s3://{self.bucket}/{key} is malformed: {exc}") from exc
            found.append((key, key.removeprefix(prefix).removesuffix(".json"), captured))
        return found

    def get_shadow(self, index_key: str, request_id: str) -> Envelope:
        """The shadow envelope a shadow index entry points at, checked like every entry (`_check_index`) and
        refused (`StoreError`) when it is not a shadow."""
        envelope = self._envelope_from_index(index_key, f"shadow of {request_id!r}", request_id=request_id)
        if envelope.shadow is None:
            raise StoreError(f"index object s3://{self.bucket}/{index_key} points at a production envelope")
        return envelope

    def list_tenant(self, tenant: str, *, limit: int | None = None) -> list[Envelope]:
        """Envelopes recorded for `tenant` (``envelopes/tenant=<tenant>/``, key order = day, then envelope id),
        at most `limit`; `EnvelopeNotFoundError` when there is none. A release gate's golden-set selector."""
        if not is_valid_request_id(tenant):
            raise EnvelopeNotFoundError(f"{tenant!r} is not a valid tenant")
        keys = self._list(tenant_envelopes_prefix(tenant))[:limit]
        if not keys:
            raise EnvelopeNotFoundError(f"no envelope is recorded for tenant {tenant!r}")
        envelopes = []
        for key in keys:
            data = self._get(key)
            if data is None:
                continue  # shredded between list and get
            try:
                envelopes.append(decode_envelope(data))
            except ContractError as exc:
                raise StoreError(f"stored envelope s3://{self.bucket}/{key} does not decode: {exc}") from exc
        return envelopes

    def list_envelopes(self, prefix: str, *, contains: str | None = None) -> list[Envelope]:
        """Every envelope stored under a key prefix (e.g. ``envelopes/tenant=T/date=D/``), in key order; with
        ``contains``, only keys containing that text (``"/date=2026-11-29/"``: one day of every tenant).
        An object that does not decode is a `StoreError` (see `scan_envelopes` to skip those instead).

        Reads each object: meant for a day (the matrix and ``explain`` use it), not the whole bucket.
        """
        envelopes, undecodable = self.scan_envelopes(prefix, contains=contains)
        if undecodable:
            key, why = undecodable[0]
            raise StoreError(f"stored envelope s3://{self.bucket}/{key} does not decode: {why}")
        return envelopes

    def scan_envelopes(
        self, prefix: str, *, contains: str | None = None
    ) -> tuple[list[Envelope], list[tuple[str, str]]]:
        """Like `list_envelopes`, but objects that do not decode as envelopes (e.g. encrypted ones) are returned
        apart as ``(key, reason)`` instead of failing the whole listing."""
        out: list[Envelope] = []
        bad: list[tuple[str, str]] = []
        for key in self._list(prefix):
            if not is_envelope_key(key) or (contains is not None and contains not in key):
                continue
            data = self._get(key)
            if data is None:  # deleted between list and get
                continue
            try:
                out.append(decode_envelope(data))
            except ContractError as exc:
                bad.append((key, str(exc)))
        return out, bad

    # -- replay results --------------------------------------------------------------------------------------

    def get_result(self, envelope: Envelope, lane_fingerprint_sha256: str) -> ReplayResult | None:
        """The stored result of this envelope on this lane, or None if it was never replayed there. A sealed one
        is opened with its tenant's key (`NotReplayableError` once shredded)."""
        return self._read_result(result_key(envelope, lane_fingerprint_sha256))

    def results(self, envelope: Envelope) -> list[ReplayResult]:
        """Every stored result of this envelope (any lane), oldest replay first: what an auditor's page shows.
        A result filed under this envelope that names another one is a `StoreError` (moved or forged)."""
        envelope_id = envelope.envelope_id()
        found: list[ReplayResult] = []
        for key in self.list_results(envelope):
            result = self._read_result(key)
            if result is None:
                continue
            if result.event.envelope_id != envelope_id:
                raise StoreError(f"replay result s3://{self.bucket}/{key} is of envelope {result.event.envelope_id}, "
                                 f"not {envelope_id}")  # fmt: skip
            found.append(result)
        return sorted(found, key=lambda r: r.event.replayed_at)

    def _read_result(self, key: str) -> ReplayResult | None:
        """The result stored under `key` (opened with its tenant's key when sealed), or None when absent."""
        data = self._get(key)
        if data is None:
            return None
        where = f"s3://{self.bucket}/{key}"
        try:
            if is_sealed_result(data):
                sealed = decode_sealed_result(data)
                what = f"replay result {where} is sealed (tenant {sealed.tenant} is encrypted)"
                gone = f"replay result {sealed.result_id} cannot be read"
                try:
                    data_key = self._data_key(sealed.tenant, sealed.key_id, what, gone)
                    return open_replay_result(sealed, data_key)
                except SealError as exc:
                    raise ContractError(f"sealed replay result {where} does not open: {exc}") from exc
            return decode_replay_result(data)
        except ContractError as exc:
            raise StoreError(f"stored replay result {where} does not decode: {exc}") from exc

    def put_result(self, envelope: Envelope, result: ReplayResult) -> bool:
        """Write the result once (sealed under the tenant's key when the envelope came sealed). True if this call
        wrote it; False if a result was already there (kept)."""
        event = result.event
        if event.envelope_id != envelope.envelope_id():
            raise ValueError("result does not belong to this envelope")
        key = result_key(envelope, event.lane_fingerprint_sha256)
        tenant_key = self._sealing.get(event.envelope_id)
        if tenant_key is None:
            body = result.model_dump_json().encode("utf-8")
        else:
            body = seal_replay_result(
                result, tenant=tenant_key.tenant, key_id=tenant_key.key_id, data_key=tenant_key.data_key
            ).canonical()
        written = s3_call(
            "put",
            f"s3://{self.bucket}/{key}",
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=key, Body=body, ContentType="application/json", IfNoneMatch="*"
            ),
            none_if=is_already_written,
            error=StoreError,
        )
        return written is not None

    def list_results(self, envelope: Envelope) -> list[str]:
        """Keys of every stored result of this envelope (any lane): audits and tests count them."""
        return self._list(replay_results_prefix(envelope.envelope_id(), envelope.captured_at))
