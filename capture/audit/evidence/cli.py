"""``reprolane audit evidence export|verify|key``: evidence bundles an auditor can hand to someone outside.

``export`` reads the audit bucket (``REPROLANE_AUDIT_*`` settings) and signs the bundle's manifest with the
audit signing key (`capture.audit.evidence.export`). ``verify`` reads the file and the pinned key, nothing else: no
settings, no network (`capture.audit.evidence.verify`). ``key`` prints the audit key as a C2SP vkey and its
fingerprint, the two things to publish so that verifiers can pin them.

Exit codes (through `infra.cli`): 0 exported / verified; 1 the bundle failed (the first line names the part
class: envelope bytes, proof, checkpoint, signature, replay result, ...), or the record cannot be evidence;
2 bad arguments, an unreadable file or key, a file that is no bundle, an unknown request id.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from capture.audit import signing_keys
from capture.audit.errors import SigningKeyError
from schemas.errors import ContractError
from schemas.note import VerifierKey, key_fingerprint, parse_fingerprint, parse_vkey

if TYPE_CHECKING:
    from capture.audit.evidence.export import ExtraMembers
    from capture.audit.evidence.verify import PinnedKey


def _looks_like_vkey(text: str) -> bool:
    parts = text.strip().split("+", 2)
    return len(parts) == 3 and len(parts[1]) == 8 and "\n" not in text.strip()


def load_pin(key: str | None, fingerprint: str | None) -> PinnedKey:
    """The verifier's pinned key from ``--key`` (a vkey, PEM, base64 raw, or a file of any) or
    ``--key-fingerprint``."""
    from capture.audit.evidence.verify import PinnedKey

    if (key is None) == (fingerprint is None):
        raise typer.BadParameter("give exactly one of --key PUBKEY or --key-fingerprint sha256:HEX")
    if fingerprint is not None:
        return PinnedKey(fingerprint=parse_fingerprint(fingerprint))
    assert key is not None
    text = key
    path = Path(key)
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise SigningKeyError(f"public key {key}: cannot read: {exc}") from exc
    if _looks_like_vkey(text):
        try:
            vkey = parse_vkey(text)
        except ContractError:
            return PinnedKey(signing_keys.load_public(key))  # base64 of a raw key that happens to hold two '+'
        return PinnedKey(vkey.public_raw, vkey.name)
    return PinnedKey(signing_keys.load_public(key))


#: The pinned audit key of every command that checks a bundle: one of the two.
KeyOpt = Annotated[str | None, typer.Option("--key", help="the audit public key: vkey, PEM or base64 raw")]
KeyFingerprintOpt = Annotated[str | None, typer.Option("--key-fingerprint", help="sha256:HEX of the audit public key")]


def pinned_bundle(bundle: Path, key: str | None, fingerprint: str | None) -> tuple[bytes, PinnedKey]:
    """A bundle file's bytes and the key its verifier pinned (`load_pin`); a usage error when it cannot be read."""
    pin = load_pin(key, fingerprint)
    try:
        return bundle.read_bytes(), pin
    except OSError as exc:
        raise typer.BadParameter(f"{bundle}: cannot read: {exc.strerror}") from exc


def verify_cmd(
    bundle: Annotated[Path, typer.Argument(help="the bundle file")],
    key: KeyOpt = None,
    key_fingerprint_: KeyFingerprintOpt = None,
) -> None:
    """Verify a bundle offline against a pinned key; names the part that is wrong (exit 1).

    Example: reprolane audit evidence verify evidence.zip --key audit.vkey
    """
    from capture.audit.cli import echo_verdict
    from capture.audit.evidence.verify import verify_bundle

    data, pin = pinned_bundle(bundle, key, key_fingerprint_)
    report = verify_bundle(data, pin)
    problems = [p.line() for p in report.problems]
    echo_verdict(report.subject, problems[0] if problems else None, report.lines, problems)
    raise typer.Exit(0 if report.ok else 1)


def key_cmd() -> None:
    """Print the audit key as a C2SP verifier key and its fingerprint (what verifiers pin).

    Example: reprolane audit evidence key
    """
    from capture.audit.settings import AuditSettings

    settings = AuditSettings()
    vkey = VerifierKey(settings.log_origin, signing_keys.verifying_key(settings))
    typer.echo(f"vkey: {vkey.encode()}\nfingerprint: {key_fingerprint(vkey.public_raw)}")


def _make_folder(path: Path) -> None:
    """The folder a workflow's bundles go to (0700: they hold the records)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise typer.BadParameter(f"{path}: cannot make the folder: {exc.strerror}") from exc


def _write_private(path: Path, data: bytes) -> None:
    """Write a bundle 0600 (it holds the record)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    except OSError as exc:
        raise typer.BadParameter(f"{path}: cannot write: {exc.strerror}") from exc


def build_evidence_app(*, reexecutable: Callable[[], ExtraMembers] | None = None) -> typer.Typer:
    """The ``audit evidence`` commands. ``reexecutable`` makes what ``export --reexecutable`` adds (the replay
    window, the model manifest): `infra.reexecution`, which reads the replayer's schedule store, passes it (this
    package may not import the replayer), and adds ``reexecute``."""
    app = typer.Typer(
        name="evidence", no_args_is_help=True, add_completion=False, help="Evidence bundles, verifiable offline."
    )

    @app.command("export")
    def export_cmd(
        request_id: Annotated[str, typer.Argument(help="request id of the envelope (with --workflow: a workflow id)")],
        output: Annotated[
            Path, typer.Option("-o", "--output", help="the bundle file to write (a zip; with --workflow: a folder)")
        ],
        force: Annotated[bool, typer.Option("--force", help="overwrite an existing file")] = False,
        reexecute: Annotated[
            bool,
            typer.Option(
                "--reexecutable",
                help="add what re-executing it needs: its schedule window as shapes, the model manifest",
            ),
        ] = False,
        workflow: Annotated[
            bool, typer.Option("--workflow", help="the id is a workflow's: one bundle per recorded step")
        ] = False,
        tenant: Annotated[
            str | None, typer.Option("--tenant", help="with --workflow: the tenant whose steps (needed when several)")
        ] = None,
    ) -> None:
        """Write the evidence bundle of one request: stored bytes, inclusion proof, checkpoint, replays, holds.

        Example: reprolane audit evidence export rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375 --output evidence.zip
        """
        from capture.audit.evidence.export import export_bundle, workflow_requests
        from capture.audit.settings import AuditSettings
        from capture.audit.store import AuditStore

        if output.exists() and not force and not (workflow and output.is_dir() and not any(output.iterdir())):
            raise typer.BadParameter(f"{output} exists: pass --force to overwrite it")
        if reexecute and reexecutable is None:
            raise typer.BadParameter("--reexecutable: this build of the command cannot read schedules")
        if tenant is not None and not workflow:
            raise typer.BadParameter("--tenant: only with --workflow (a request id names one record)")
        settings = AuditSettings()
        private = signing_keys.signing_key(settings)
        extra = reexecutable() if reexecute and reexecutable is not None else None
        store = AuditStore.from_settings(settings)
        if not workflow:
            targets = [(output, request_id)]
        else:
            steps = workflow_requests(store, request_id, tenant)
            _make_folder(output)
            targets = [(output / f"step-{step:06d}-{rid}.zip", rid) for step, rid in steps]
        for path, rid in targets:
            done = export_bundle(store, rid, private, settings.log_origin, extra=extra)
            _write_private(path, done.bundle)
            place = done.place
            typer.echo(
                f"wrote {path} ({len(done.bundle)} bytes): request {place.request_id}, leaf {place.leaf_index} of "
                f"{place.origin}, checkpoint size {place.tree_size}, {done.replays} replay result(s)"
                + (", re-executable" if extra is not None else "")
            )
            typer.echo(f"verify offline: reprolane audit evidence verify {path} --key-fingerprint {place.fingerprint}")

    app.command("verify")(verify_cmd)
    app.command("key")(key_cmd)
    return app


evidence_app = build_evidence_app()
