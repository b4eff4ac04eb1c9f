"""What the console reads, and from where: one reader per source, none of them copied.

- envelopes, the indexes (request id, client request id, workflow, shadow) and replay results: the replayer's
  `replayer.store.EnvelopeStore` (it checks every index entry against the envelope it points at, and opens
  sealed envelopes with their tenant's key when a KEK is configured);
- searches over many records and the overview's aggregates: the audit lake through
  `capture.audit.lake.query.connect` (DuckDB over the Parquet lake, locked down), with the caller's values bound as
  parameters, never spliced into the SQL;
- inclusion in the Merkle log against the latest signed checkpoint: `capture.audit.verify.verify_request`;
- legal holds: `capture.audit.store.AuditStore` on the envelope object's current version, and who placed or
  lifted them and why from the access records filed under the envelope (`capture.audit.access_log`);
- evidence bundles: `capture.audit.evidence.export.export_bundle`, the same export as
  ``reprolane audit evidence export``, signed with the audit signing key when the console is given one
  (`EvidenceSigner`).

Every method takes the operator's tenant scope: a key scoped to a tenant reads that tenant's records only, and a
record of another tenant is answered as absent (`NotVisible`), so a scoped key cannot probe others' ids.
Everything here blocks (boto3, DuckDB): the web layer calls it from a worker thread.
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from capture.audit.access_log import hold_decisions
from capture.audit.errors import AuditError, SigningKeyError
from capture.audit.evidence.export import export_bundle
from capture.audit.lake.query import connect
from capture.audit.lake.store import Lake
from capture.audit.signing_keys import public_of
from capture.audit.store import AuditStore
from capture.audit.verify import verify_request
from replayer.errors import EnvelopeNotFoundError, ReplayerError
from replayer.gate.replay import GateReport
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayResult
from schemas.access_log import AccessRecord
from schemas.errors import ContractError
from schemas.layout import capture_day, envelope_key, shadow_index_key
from schemas.note import key_fingerprint

#: Verdicts that count as "the tokens held" in the divergence rate (the lake's own example query says the same).
HELD_VERDICTS = ("bitwise", "token")
_GATE_REPORTS_SHOWN = 50


class NotVisible(Exception):
    """No such record, or not one of the operator's tenant (the two are answered alike)."""


@dataclass(frozen=True)
class EvidenceSigner:
    """The audit signing key an evidence bundle's manifest is signed with, and its C2SP key name."""

    private_raw: bytes = field(repr=False)
    key_name: str

    @property
    def fingerprint(self) -> str:
        """What a verifier pins (``--key-fingerprint``), as ``reprolane audit evidence key`` prints it."""
        return key_fingerprint(public_of(self.private_raw))


@dataclass(frozen=True)
class Filters:
    """A search, parsed and bounded at the edge (`infra.console.forms`)."""

    request_id: str | None = None
    client_request_id: str | None = None
    workflow_id: str | None = None
    tenant: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    verdict: str | None = None
    runtime: str | None = None

    def empty(self) -> bool:
        return all(v is None for v in vars(self).values())

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in vars(self).items() if v is not None) or "(all)"


@dataclass(frozen=True)
class Row:
    request_id: str
    client_request_id: str | None
    tenant: str
    captured_at: datetime
    model: str
    workflow: str | None
    runtime_sha256: str | None
    verdicts: str


@dataclass(frozen=True)
class SearchPage:
    """One page of a search's rows (newest first), how many rows match in all, and where they came from."""

    rows: list[Row]
    total: int
    page: int
    per_page: int
    #: "index": an id looked up in the capture index (current); "lake": the audit lake (as current as the archiver).
    source: str

    @property
    def pages(self) -> int:
        return max(1, -(-self.total // self.per_page))

    @property
    def first(self) -> int:
        """The 1-based number of the page's first row (0 when the page is empty)."""
        return (self.page - 1) * self.per_page + 1 if self.rows else 0

    @property
    def last(self) -> int:
        return (self.page - 1) * self.per_page + len(self.rows)


@dataclass(frozen=True)
class Inclusion:
    ok: bool
    lines: list[str]
    problems: list[str]


@dataclass(frozen=True)
class Hold:
    key: str
    version_id: str | None
    held: bool
    retain_until: datetime | None
    #: Who placed or lifted the hold, when, why (`capture.audit.access_log.hold_decisions`), newest first.
    decisions: list[AccessRecord] = field(default_factory=list)
    #: Filed decisions that do not read.
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RequestRecord:
    envelope: Envelope
    results: list[ReplayResult]
    inclusion: Inclusion
    hold: Hold
    #: The candidate's shadow of this request (`capture.request.shadow`), when one was recorded and pairs with it.
    shadow: Envelope | None = None
    #: Why a shadow that was found is not shown (another tenant's, not this envelope's, does not read).
    shadow_problem: str | None = None


@dataclass(frozen=True)
class Step:
    envelope: Envelope
    results: list[ReplayResult]

    @property
    def diverged(self) -> bool:
        return any(r.event.verdict not in HELD_VERDICTS for r in self.results)


@dataclass(frozen=True)
class Overview:
    by_runtime: list[dict[str, Any]] = field(default_factory=list)
    positions: list[tuple[int, int]] = field(default_factory=list)
    lags_s: list[float] = field(default_factory=list)
    verified: list[dict[str, Any]] = field(default_factory=list)  # `VERIFIED_SQL`'s rows
    gate_runs: list[GateReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def replays(self) -> int:
        return sum(int(r["replays"]) for r in self.by_runtime)

    @property
    def verified_share(self) -> tuple[int, int]:
        """(verified, verifiable) envelopes over every hour shown."""
        return sum(int(r["verified"]) for r in self.verified), sum(int(r["envelopes"]) for r in self.verified)

    @property
    def diverged(self) -> int:
        return sum(int(r["diverged"]) for r in self.by_runtime)


def _visible(envelope: Envelope, scope: str | None) -> Envelope:
    if scope is not None and envelope.tenant != scope:
        raise NotVisible(envelope.request_id)
    return envelope


_SEARCH_FROM = """
FROM envelopes e LEFT JOIN divergences d USING (envelope_id)
WHERE ($tenant IS NULL OR e.tenant = $tenant)
  AND ($client_request_id IS NULL OR e.client_request_id = $client_request_id)
  AND ($since IS NULL OR e.captured_at >= $since)
  AND ($until IS NULL OR e.captured_at < $until)
  AND ($runtime IS NULL OR starts_with(e.runtime_sha256, $runtime) OR e.rt_system_fingerprint = $runtime)
GROUP BY ALL
HAVING $verdict IS NULL OR bool_or(d.verdict = $verdict)
"""
#: One page of the lake's matches, each row with the number of matches in all (a window over the groups).
SEARCH_SQL = f"""
SELECT e.request_id, e.client_request_id, e.tenant, e.captured_at, e.model,
       CASE WHEN e.workflow_id IS NULL THEN NULL ELSE e.workflow_id || ' step ' || e.workflow_step END,
       e.runtime_sha256, coalesce(string_agg(DISTINCT d.verdict, ', ' ORDER BY d.verdict), ''),
       count(*) OVER () AS total
{_SEARCH_FROM}
ORDER BY e.captured_at DESC, e.request_id
LIMIT $limit OFFSET $offset
"""
#: The number of matches alone (a page past the last one has no row to carry it).
SEARCH_COUNT_SQL = f"SELECT count(*) FROM (SELECT e.envelope_id {_SEARCH_FROM})"

BY_RUNTIME_SQL = f"""
SELECT date_trunc('hour', d.replayed_at) AS hour, e.model, e.runtime_sha256, count(*) AS replays,
       count(*) FILTER (WHERE d.verdict NOT IN {HELD_VERDICTS}) AS diverged,
       avg(CASE WHEN d.verdict IN {HELD_VERDICTS} THEN 0.0 ELSE 1.0 END) AS divergence_rate
FROM divergences d JOIN envelopes e USING (envelope_id)
WHERE $tenant IS NULL OR e.tenant = $tenant
GROUP BY ALL ORDER BY ALL
"""

POSITIONS_SQL = """
SELECT d.first_divergence_position, count(*) FROM divergences d
WHERE d.first_divergence_position IS NOT NULL AND ($tenant IS NULL OR d.tenant = $tenant)
GROUP BY ALL ORDER BY ALL
"""

LAG_SQL = """
SELECT epoch(d.replayed_at) - epoch(e.captured_at) FROM divergences d JOIN envelopes e USING (envelope_id)
WHERE $tenant IS NULL OR e.tenant = $tenant
"""

#: Per hour of capture: the traffic that can be verified, how much of it was (the lake's ``verification`` view),
#: and the lag of the verified part (median, 95th percentile).
VERIFIED_SQL = """
SELECT date_trunc('hour', captured_at) AS hour, count(*) AS envelopes, count(*) FILTER (WHERE verified) AS verified,
       quantile_cont(lag_s, 0.5) AS lag_p50, quantile_cont(lag_s, 0.95) AS lag_p95
FROM verification WHERE verifiable AND ($tenant IS NULL OR tenant = $tenant)
GROUP BY ALL ORDER BY ALL
"""


@dataclass(eq=False)  # a service, compared by identity
class Records:
    """The console's reads (see module docstring)."""

    store: EnvelopeStore
    audit: AuditStore
    lake: Lake | None
    _: KW_ONLY
    public_key: bytes | None
    gate_reports_dir: Path | None = None
    signer: EvidenceSigner | None = None

    # -- search ------------------------------------------------------------------------------------------------

    def search(self, filters: Filters, scope: str | None, page: int = 1, per_page: int = 50) -> SearchPage:
        """Page `page` (1-based, `per_page` rows, newest first) of the rows matching `filters` in the operator's
        scope; no filter at all: every request in scope, newest first. A request id, a workflow id and a client
        request id of a named tenant are looked up in the store's index, so a request is found before the archiver
        has put it in the lake; the rest is the lake's (a client request id without a tenant too: the lake has the
        column, and the tenant column tells apart two tenants' requests that share the label)."""
        tenant = scope or filters.tenant
        if scope is not None and filters.tenant not in (None, scope):
            return SearchPage([], 0, page, per_page, "index")
        if filters.request_id is not None:
            try:
                envelopes = [self.store.get_by_request_id(filters.request_id)]
            except EnvelopeNotFoundError:
                envelopes = []
            rows = [self._row(e) for e in envelopes if tenant is None or e.tenant == tenant]
            return _paged(rows, page, per_page)
        if filters.workflow_id is not None:
            try:
                rows = [s.row for s in self._steps(filters.workflow_id, tenant)]
            except NotVisible:
                rows = []
            return _paged(rows, page, per_page)
        if filters.client_request_id is not None and tenant is not None:
            try:
                envelopes = self.store.find_by_client_request_id(tenant, filters.client_request_id)
            except EnvelopeNotFoundError:
                envelopes = []
            return _paged([self._row(e) for e in reversed(envelopes)], page, per_page)
        return self._lake_rows(filters, tenant, page, per_page)

    def _row(self, envelope: Envelope, results: list[ReplayResult] | None = None) -> Row:
        results = self.store.results(envelope) if results is None else results
        wf = envelope.workflow
        return Row(
            envelope.request_id,
            envelope.client_request_id,
            envelope.tenant,
            envelope.captured_at,
            envelope.model,
            f"{wf.workflow_id} step {wf.step}" if wf is not None else None,
            envelope.runtime.sha256(),
            ", ".join(sorted({r.event.verdict for r in results})),
        )

    def _lake(self) -> Any:
        if self.lake is None:
            raise AuditError("no lake is configured (REPROLANE_ARCHIVER_LAKE_BUCKET): only id lookups work")
        return connect(self.lake)

    def _lake_rows(self, filters: Filters, tenant: str | None, page: int, per_page: int) -> SearchPage:
        con = self._lake()
        try:
            params: dict[str, Any] = {
                "tenant": tenant,
                "client_request_id": filters.client_request_id,
                "since": filters.since,
                "until": filters.until,
                "verdict": filters.verdict,
                "runtime": filters.runtime,
            }
            found = con.execute(SEARCH_SQL, {**params, "limit": per_page, "offset": (page - 1) * per_page}).fetchall()
            if found:
                total = int(found[0][-1])
            else:
                (total,) = con.execute(SEARCH_COUNT_SQL, params).fetchone() or (0,)
        finally:
            con.close()
        return SearchPage([Row(*row[:-1]) for row in found], int(total), page, per_page, "lake")

    # -- one request, one workflow -----------------------------------------------------------------------------

    def request(self, request_id: str, scope: str | None) -> RequestRecord:
        try:
            envelope = _visible(self.store.get_by_request_id(request_id), scope)
        except EnvelopeNotFoundError as exc:
            raise NotVisible(request_id) from exc
        shadow, problem = self.shadow(envelope)
        return RequestRecord(envelope, self.store.results(envelope), self.inclusion(request_id), self.hold(envelope),
                             shadow, problem)  # fmt: skip

    def shadow(self, envelope: Envelope) -> tuple[Envelope | None, str | None]:
        """The shadow of `envelope` (its own index entry, `schemas.layout.shadow_index_key`, of the capture day or
        the next: a shadow is captured after its production answer), if any, and why one found is not shown. A
        shadow is shown only when it names this very envelope and is of its tenant."""
        day = envelope.captured_at.astimezone(UTC)
        for at in (day, day + timedelta(days=1)):
            key = shadow_index_key(capture_day(at), envelope.request_id)
            try:
                shadow = self.store.get_shadow(key, envelope.request_id)
            except EnvelopeNotFoundError:
                continue
            except READ_ERRORS as exc:
                return None, f"the shadow does not read: {str(exc).splitlines()[0]}"
            assert shadow.shadow is not None  # get_shadow refuses a production envelope
            if shadow.tenant != envelope.tenant or shadow.shadow.production_envelope_id != envelope.envelope_id():
                return None, "a shadow is indexed under this request id, but it names another production envelope"
            return shadow, None
        return None, None

    def envelope(self, request_id: str, scope: str | None) -> Envelope:
        try:
            return _visible(self.store.get_by_request_id(request_id), scope)
        except EnvelopeNotFoundError as exc:
            raise NotVisible(request_id) from exc

    def inclusion(self, request_id: str) -> Inclusion:
        """The Merkle inclusion of the request's envelope against the latest signed checkpoint covering it."""
        if self.public_key is None:
            return Inclusion(False, [], ["no checkpoint public key is configured (REPROLANE_AUDIT_PUBLIC_KEY)"])
        try:
            verdict = verify_request(self.audit, request_id, self.public_key)
        except AuditError as exc:
            return Inclusion(False, [], [str(exc)])
        return Inclusion(verdict.ok, list(verdict.lines), [f.message for f in verdict.findings])

    def hold(self, envelope: Envelope) -> Hold:
        key = envelope_key(envelope.envelope_id(), envelope.tenant, envelope.captured_at)
        version = self.audit.current_version(key)
        decisions, problems = hold_decisions(self.audit, envelope.envelope_id())
        if version is None:
            return Hold(key, None, False, None, decisions, problems)
        held, until = self.audit.legal_hold(key, version), self.audit.retain_until(key, version)
        return Hold(key, version, held, until, decisions, problems)

    def set_hold(self, envelope: Envelope, on: bool) -> Hold:
        """Place or lift the legal hold on this one envelope object's current version. Not
        `capture.audit.retention.set_hold`: that takes any id and also holds every step of a workflow of that
        name, which can be another tenant's (a workflow id is a client's label); the console acts on the one
        record the operator is looking at."""
        hold = self.hold(envelope)
        if hold.version_id is None:
            raise NotVisible(envelope.request_id)
        self.audit.set_legal_hold(hold.key, hold.version_id, on)
        return self.hold(envelope)

    def evidence(self, envelope: Envelope) -> bytes:
        """The evidence bundle (a zip) of `envelope`, which the caller has already checked is in the operator's
        scope; `capture.audit.evidence.export.EvidenceError` when it cannot be evidence yet (no C2SP checkpoint covers
        it, or it does not verify), `SigningKeyError` when the console holds no signing key."""
        if self.signer is None:
            raise SigningKeyError(
                "no audit signing key is configured (REPROLANE_AUDIT_SIGNING_KEY): run "
                "`reprolane audit evidence export` where the key is kept"
            )
        return export_bundle(self.audit, envelope.request_id, self.signer.private_raw, self.signer.key_name).bundle

    def _steps(self, workflow_id: str, tenant: str | None) -> list[_StepRow]:
        try:
            envelopes = self.store.list_workflow(workflow_id, tenant)
        except EnvelopeNotFoundError as exc:
            raise NotVisible(workflow_id) from exc
        out = []
        for env in envelopes:
            results = self.store.results(env)
            out.append(_StepRow(Step(env, results), self._row(env, results)))
        return out

    def workflow(self, workflow_id: str, tenant: str | None, scope: str | None) -> list[Step]:
        """The workflow's steps in order; `tenant` picks whose when several tenants used the id (the store refuses
        to mix them), a scoped operator always gets its own."""
        if scope is not None and tenant not in (None, scope):
            raise NotVisible(workflow_id)
        return [s.step for s in self._steps(workflow_id, scope or tenant)]

    # -- overview ----------------------------------------------------------------------------------------------

    def overview(self, scope: str | None) -> Overview:
        problems: list[str] = []
        by_runtime: list[dict[str, Any]] = []
        positions: list[tuple[int, int]] = []
        lags: list[float] = []
        verified: list[dict[str, Any]] = []
        try:
            con = self._lake()
            try:
                params = {"tenant": scope}
                cols = ("hour", "model", "runtime_sha256", "replays", "diverged", "divergence_rate")
                by_runtime = [dict(zip(cols, r, strict=True)) for r in con.execute(BY_RUNTIME_SQL, params).fetchall()]
                positions = [(int(p), int(n)) for p, n in con.execute(POSITIONS_SQL, params).fetchall()]
                lags = [float(v) for (v,) in con.execute(LAG_SQL, params).fetchall() if v is not None]
                shares = ("hour", "envelopes", "verified", "lag_p50", "lag_p95")
                verified = [dict(zip(shares, r, strict=True)) for r in con.execute(VERIFIED_SQL, params).fetchall()]
            finally:
                con.close()
        except AuditError as exc:
            problems.append(str(exc))
        gates, gate_problems = self.gate_runs() if scope is None else ([], [])
        return Overview(by_runtime, positions, lags, verified, gates, problems + gate_problems)

    def gate_runs(self) -> tuple[list[GateReport], list[str]]:
        """Release-gate reports (``release gate --report FILE.json``) in the configured folder, newest first. Gate runs
        are not any one tenant's, so only an operator of every tenant sees them."""
        if self.gate_reports_dir is None:
            return [], []
        reports: list[GateReport] = []
        problems: list[str] = []
        for path in sorted(self.gate_reports_dir.glob("*.json"))[-_GATE_REPORTS_SHOWN:]:
            try:
                reports.append(GateReport.model_validate(json.loads(path.read_bytes())))
            except (OSError, ValueError) as exc:
                problems.append(f"gate report {path.name} does not read: {str(exc).splitlines()[0]}")
        return sorted(reports, key=lambda r: r.started_at, reverse=True), problems


def _paged(rows: list[Row], page: int, per_page: int) -> SearchPage:
    start = (page - 1) * per_page
    return SearchPage(rows[start : start + per_page], len(rows), page, per_page, "index")


@dataclass(frozen=True)
class _StepRow:
    step: Step
    row: Row


#: What a read can fail with that a page shows as a message (the store or lake down, a record that does not decode).
READ_ERRORS: tuple[type[Exception], ...] = (AuditError, ReplayerError, ContractError)
