"""The audit commands: ``reprolane audit verify``, ``audit hold``, ``audit expire``, ``audit checkpoint``,
``audit reconcile``, ``serve checkpointer`` and ``keys signing``.

`verify_command` and `expire_command` are single commands (``app.command(...)``); `hold_app` and `audit_app`
are groups.

Settings come from ``REPROLANE_AUDIT_*`` (a running local stack provides the S3 ones, see infra/stack/env.py).
``hold`` and ``expire`` act only for an operator key with the role (hold-admin, retention-admin) and in its tenant
scope (`capture.audit.operators`); each decision is written to the access log first.
Exit codes: 0 done / verified; 1 a verification failed (the first line names what) or the store failed;
2 an unknown id or day, bad arguments or settings, missing keys, or an operator refused. The commands raise
(`capture.audit.errors`, ``typer.BadParameter``); the root of the command line (`infra.cli`) prints one line on
stderr and picks the code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer

from capture.audit import signing_keys
from capture.audit.checkpoint import merkle_logs, reconcile, write_checkpoint
from capture.audit.operator_cli import OperatorKeyFileOpt, operator_gate
from capture.audit.retention import expire, hold_entries, resolve
from capture.audit.settings import AuditSettings
from capture.audit.store import AuditStore
from capture.audit.verify import Verdict, verify_range, verify_request, verify_schedule_log
from schemas.access_log import CASE_PATTERN, MAX_NOTE, OperatorAction
from schemas.layout import ENVELOPES_PREFIX, envelope_id_of_key, tenant_envelopes_prefix
from schemas.schedule_delivery import is_engine_id

hold_app = typer.Typer(name="hold", no_args_is_help=True, add_completion=False, help="Legal holds.")
audit_app = typer.Typer(name="audit", no_args_is_help=True, add_completion=False, help="The Merkle log's jobs.")


def _store(settings: AuditSettings) -> AuditStore:
    return AuditStore.from_settings(settings)


def _retention(days: int) -> timedelta | None:
    return timedelta(days=days) if days > 0 else None


def echo_verdict(subject: str, failure: str | None, lines: list[str], notes: list[str]) -> None:
    """How every verification command answers (``reprolane audit verify``, ``audit evidence verify``): one line
    ``verified SUBJECT`` or ``FAILED SUBJECT: first failure``, then what was checked, then every finding."""
    typer.echo(f"verified {subject}" if failure is None else f"FAILED {subject}: {failure}")
    for line in [*lines, *(f"  - {note}" for note in notes)]:
        typer.echo(line)


def _print_verdict(verdict: Verdict) -> None:
    fatal = next((f.message for f in verdict.findings if f.fatal), None)
    echo_verdict(verdict.subject, fatal, verdict.lines, [f.message for f in verdict.findings])


def _parse_range(spec: str) -> tuple[str, int | None, int | None]:
    parts = spec.split(":")
    try:
        datetime.strptime(parts[0], "%Y-%m-%d")
        if len(parts) == 1:
            return parts[0], None, None
        if len(parts) == 3:
            return parts[0], int(parts[1]), int(parts[2])
    except ValueError:
        pass
    raise typer.BadParameter(f"--range {spec!r}: expected DAY or DAY:FROM_SIZE:TO_SIZE (DAY as YYYY-MM-DD)")


def verify_command(
    request_id: Annotated[str | None, typer.Argument(help="request id of the envelope to prove")] = None,
    range_: Annotated[
        str | None, typer.Option("--range", help="DAY[:FROM_SIZE:TO_SIZE]: check a day's log and objects")
    ] = None,
    schedule: Annotated[
        str | None, typer.Option("--schedule", help="ENGINE_ID: check an engine's schedule log and its segments")
    ] = None,
) -> None:
    """Prove one envelope's inclusion (REQUEST_ID), a day's consistency (--range), or an engine's schedule log's
    (--schedule).

    Example: reprolane audit verify rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375
    """
    if sum(x is not None for x in (request_id, range_, schedule)) != 1:
        raise typer.BadParameter("give exactly one of REQUEST_ID, --range DAY[:FROM:TO] or --schedule ENGINE_ID")
    if schedule is not None and not is_engine_id(schedule):
        raise typer.BadParameter(f"--schedule {schedule[:80]!r}: not an engine id")
    settings = AuditSettings()
    public = signing_keys.verifying_key(settings)
    store = _store(settings)
    if request_id is not None:
        verdict = verify_request(store, request_id, public)
    elif schedule is not None:
        verdict = verify_schedule_log(store, schedule, public)
    else:
        assert range_ is not None
        day, lo, hi = _parse_range(range_)
        verdict = verify_range(store, day, public, lo, hi)
    _print_verdict(verdict)
    raise typer.Exit(0 if verdict.ok else 1)


TenantOpt = Annotated[
    str | None, typer.Option("--tenant", help="only this tenant's records (default: your operator key's tenant)")
]


def _hold(some_id: str, on: bool, tenant: str | None, key_file: Path | None, reason: str | None,
          case: str | None) -> None:  # fmt: skip
    """Authorise (hold-admin, in the key's tenant scope), then hold exactly one tenant's records of the id; the
    decision's access record carries the reason and case number and is filed under each envelope it holds."""
    reason = " ".join(reason.split()) if reason is not None else None  # one line: the record's note is one
    if reason is not None and not 0 < len(reason) <= MAX_NOTE:
        raise typer.BadParameter(f"--reason: 1 to {MAX_NOTE} characters")
    if case is not None and not re.fullmatch(CASE_PATTERN, case):
        raise typer.BadParameter("--case: up to 64 of [A-Za-z0-9 ._:/#-], starting with a letter or digit")
    store = _store(AuditSettings())
    gate = operator_gate(store, key_file)
    action: OperatorAction = "hold.add" if on else "hold.remove"
    tenant = gate.scope(action, some_id, tenant)
    entries = resolve(store, some_id, tenant)
    tenants = sorted({e.tenant for e in entries})
    if len(tenants) != 1:  # a request id and a workflow id of the same name, of two tenants
        raise typer.BadParameter(f"{some_id!r} names records of tenants {', '.join(tenants)}: pass --tenant")
    held = [envelope_id_of_key(e.key) for e in entries]
    gate.authorise(action, some_id, tenants[0], note=reason, case=case, held_envelopes=held)
    for obj in hold_entries(store, entries, on):
        typer.echo(f"legal hold {'ON ' if on else 'OFF'} {obj.key} (version {obj.version_id})")


def _hold_command(on: bool, doc: str) -> Callable[..., None]:
    """``hold add`` and ``hold remove``: one signature, the direction bound."""

    def command(
        some_id: Annotated[str, typer.Argument(metavar="REQUEST_ID|WORKFLOW_ID")],
        tenant: TenantOpt = None,
        operator_key_file: OperatorKeyFileOpt = None,
        reason: Annotated[
            str | None,
            typer.Option("--reason", help="why (kept in the access log; the console shows it on the record's page)"),
        ] = None,
        case: Annotated[str | None, typer.Option("--case", help="the case or matter number it is for")] = None,
    ) -> None:
        _hold(some_id, on, tenant, operator_key_file, reason, case)

    command.__doc__ = doc
    return command


hold_app.command("add")(
    _hold_command(
        True,
        "Place a legal hold on an envelope, or on every step of one tenant's workflow (needs hold-admin).\n\n"
        'Example: reprolane audit hold add rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375 --reason "litigation" --case CASE-42',
    )
)
hold_app.command("remove")(
    _hold_command(
        False,
        "Lift a legal hold (needs hold-admin).\n\n"
        'Example: reprolane audit hold remove rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375 --reason "case closed" '
        "--case CASE-42",
    )
)


def expire_command(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="report, delete nothing")] = False,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="only this tenant's envelopes (default: your key's tenant, or all)")
    ] = None,
    operator_key_file: OperatorKeyFileOpt = None,
) -> None:
    """Delete envelope versions past their retain-until date and not under legal hold; report what was kept
    (needs retention-admin; a key scoped to a tenant expires that tenant's envelopes only).

    Example: reprolane audit expire --dry-run --operator-key-file alice.key
    """
    settings = AuditSettings()
    store = _store(settings)
    gate = operator_gate(store, operator_key_file)
    tenant = gate.scope("expire", ENVELOPES_PREFIX, tenant)
    prefix = tenant_envelopes_prefix(tenant) if tenant else ENVELOPES_PREFIX
    gate.authorise("expire", prefix + (" (dry run)" if dry_run else ""), tenant)
    retention = _retention(settings.log_retention_days)
    report = expire(store, dry_run=dry_run, prefix=prefix, report_retention=retention)
    counts = report.counts()
    verb = "would delete" if dry_run else "deleted"
    typer.echo(
        f"{verb} {counts['deleted']}; kept held {counts['held']}, retained {counts['retained']}, "
        f"unretained {counts['unretained']}; refused {counts['refused']}"
    )
    for entry in report.deleted:
        typer.echo(f"  {verb}: {entry['key']} (version {entry['version_id']})")
    for name in report.held:
        typer.echo(f"  held: {name}")
    for line in report.refused:
        typer.echo(f"  refused: {line}")
    if report.report_key:
        typer.echo(f"report: s3://{store.bucket}/{report.report_key}")
    raise typer.Exit(1 if report.refused else 0)


@audit_app.command("checkpoint")
def checkpoint_cmd(
    day: Annotated[
        str | None,
        typer.Option("--day", help="YYYY-MM-DD: that day's log alone (default: every log, days and schedules)"),
    ] = None,
) -> None:
    """Sign a checkpoint of each log that grew since its last checkpoint: day logs, engines' schedule logs.

    Example: reprolane audit checkpoint --day 2026-07-14
    """
    settings = AuditSettings()
    private = signing_keys.signing_key(settings)
    store = _store(settings)
    for d in merkle_logs(store, [day] if day else None):
        cp = write_checkpoint(
            store, d, private, retention=_retention(settings.log_retention_days), key_name=settings.log_origin
        )
        if cp is None:
            typer.echo(f"{d}: up to date")
        else:
            typer.echo(f"{d}: checkpoint size {cp.tree_size} root {cp.root_hash} ({cp.signer})")


@audit_app.command("checkpointer")
def checkpointer_cmd(
    every: Annotated[float, typer.Option("--every", min=0.1, help="seconds between rounds")] = 60.0,
    once: Annotated[bool, typer.Option("--once", help="one round, then exit (1 when a log was refused)")] = False,
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="serve metrics on 127.0.0.1")] = None,
    day: Annotated[list[str] | None, typer.Option("--day", help="only this YYYY-MM-DD (repeatable)")] = None,
) -> None:
    """Sign a checkpoint of every log that grew, every --every seconds, each checked for consistency with the
    previous one first; an inconsistent log is refused, logged and counted (capture.audit.checkpointer).

    Example: reprolane serve checkpointer --every 60 --metrics-port 9103
    """
    import logging

    from capture.audit.checkpointer import Checkpointer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = AuditSettings()
    service = Checkpointer(
        _store(settings),
        signing_keys.signing_key(settings),
        key_name=settings.log_origin,
        retention=_retention(settings.log_retention_days),
        only_days=day or None,
    )
    if metrics_port is not None:
        service.metrics.serve(metrics_port)
    if once:
        report = service.run_round()
        for head in report.signed:
            typer.echo(f"signed {head.key} root {head.root_hash}")
        for refused_day, why in report.refused.items():
            typer.echo(f"REFUSED {refused_day}: {why}")
        raise typer.Exit(1 if report.refused else 0)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: service.stop.set())
    try:
        service.run(every)
    except KeyboardInterrupt:
        service.stop.set()


@audit_app.command("reconcile")
def reconcile_cmd(
    day: Annotated[str, typer.Option("--day", help="YYYY-MM-DD")],
    dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
) -> None:
    """Append the ids of a day's stored envelopes that are in no leaf (after a crash); names each one.

    Example: reprolane audit reconcile --day 2026-07-14 --dry-run
    """
    settings = AuditSettings()
    store = _store(settings)
    missing = reconcile(store, day, retention=_retention(settings.log_retention_days), dry_run=dry_run)
    typer.echo(f"{day}: {len(missing)} stored envelope(s) not in the log{' (dry run)' if dry_run else ' appended'}")
    for eid in missing:
        typer.echo(f"  {eid}")


@audit_app.command("keygen")
def keygen_cmd(path: Annotated[Path, typer.Argument(help="where to write the private key (PEM)")]) -> None:
    """Make an Ed25519 signing key (PEM, 0600) and PATH.pub; prints the public key (base64 raw).

    Example: reprolane keys signing audit-signing.pem
    """
    public_path, public_b64 = signing_keys.keygen(path)
    typer.echo(f"private key: {path}\npublic key: {public_path}\npublic key (base64 raw): {public_b64}")
