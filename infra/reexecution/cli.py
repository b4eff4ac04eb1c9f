"""``reprolane audit evidence``, whole: the audit side's ``export`` (with ``--reexecutable``, which reads the
replayer's schedule store), ``verify`` and ``key`` (`capture.audit.evidence.cli`), and ``reexecute``.

``reexecute`` takes one bundle or several (a workflow's folder, as ``export --workflow`` writes it): each is
checked before any runs, and the bundles of one recorded engine share one lane. Exit codes (through
`infra.cli`): 0 every request was reproduced bit for bit in its recorded schedule; 1 one was not (the report
shows the first divergent token and the top-k on both sides), or a bundle fails its check (the part named) or is
not re-executable; 2 this machine cannot replay them (a model file or a numeric field of the runtime differs: each
named), bad arguments, a file that is no bundle.

With ``--json`` it prints one JSON document instead of the text, shaped as ``replay workflow --json``'s: under
``requests``, one entry per bundle in the order run, holding the bundle's path, the request id, whether it was
reproduced bit for bit, which engine started here replayed it, and as ``result`` the document ``replay request
--json`` prints for a replay; beside it ``engines``, how many engines were started. The exit codes are the same;
a command that fails before any verdict prints no document (the error is on stderr, as without ``--json``).

With ``--receipt FILE --receipt-key KEY --receipt-name NAME`` it also writes a re-execution receipt signed with the
re-executor's own key (`schemas.receipt`: each bundle's sha256, its request, verdict and this runtime's
fingerprint); ``receipt RECEIPT [BUNDLE...] --key VKEY`` checks one (exit 1: not signed by that key, or a bundle
named is not in it).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from capture.audit.evidence.cli import KeyFingerprintOpt, KeyOpt, build_evidence_app, pinned_bundle
from capture.audit.evidence.export import ExtraMembers

if TYPE_CHECKING:
    from infra.reexecution.run import Reexecuted


def _members() -> ExtraMembers:
    """``export --reexecutable``'s members, read with the replayer's settings (``REPROLANE_REPLAYER_*``: its S3,
    where the schedule shipper writes; the model directory the deployment serves)."""
    from infra import paths
    from infra.reexecution.export import reexecutable_members
    from replayer.schedule.store import ScheduleStore
    from replayer.settings import ReplayerSettings

    settings = ReplayerSettings()
    return reexecutable_members(ScheduleStore.from_settings(settings), settings.model_dir or paths.model_dir())


evidence_app = build_evidence_app(reexecutable=_members)


def _bundle_files(paths: list[Path]) -> list[Path]:
    """The bundles named: files as given, a folder (``export --workflow``'s) as its ``*.zip`` in name order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.zip"))
            if not found:
                raise typer.BadParameter(f"{path}: a folder with no bundle (*.zip) in it")
            files += found
        else:
            files.append(path)
    return files


@evidence_app.command("reexecute")
def reexecute_cmd(
    bundles: Annotated[
        list[Path], typer.Argument(help="bundles exported with --reexecutable, or the folder of a workflow's")
    ],
    model_dir: Annotated[Path, typer.Option("--model-dir", help="the model files, as the bundle's manifest lists")],
    key: KeyOpt = None,
    key_fingerprint_: KeyFingerprintOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the verdicts and replay results as JSON")] = False,
    receipt: Annotated[
        Path | None, typer.Option("--receipt", help="write a receipt signed with --receipt-key (schemas.receipt)")
    ] = None,
    receipt_key: Annotated[
        str | None, typer.Option("--receipt-key", help="your Ed25519 private key: a PEM file, or base64 of 32 bytes")
    ] = None,
    receipt_name: Annotated[
        str | None, typer.Option("--receipt-name", help="the key's name in the receipt's signature (example.org/you)")
    ] = None,
) -> None:
    """Re-execute bundles offline: check each, the model files and this runtime; replay; say if each is bit for bit.

    Example: reprolane audit evidence reexecute evidence.zip --model-dir smollm2 --key-fingerprint sha256:ab12
    """
    from infra.reexecution.run import reexecute_all
    from replayer.machine_output import machine_output

    signer = _receipt_signer(receipt, receipt_key, receipt_name)
    files = _bundle_files(bundles)
    pinned = [pinned_bundle(path, key, key_fingerprint_) for path in files]
    with machine_output(True) as document:  # the verdicts alone on stdout: the engine's logs on stderr
        done = reexecute_all([data for data, _ in pinned], pinned[0][1], model_dir)
        if receipt is not None and signer is not None:  # written whatever the verdicts: a fork is a finding too
            _write_receipt(receipt, signer, [data for data, _ in pinned], done)
        engines = len({one.engine for one in done})
        if as_json:
            document(json.dumps(_json(files, done, engines), indent=2, ensure_ascii=False))
        else:
            document(_text(done, engines))
    raise typer.Exit(0 if all(one.reproduced for one in done) else 1)


def _receipt_signer(receipt: Path | None, key: str | None, name: str | None) -> tuple[str, bytes] | None:
    """(key name, private key) for ``--receipt``, checked before anything runs; None without ``--receipt``."""
    from capture.audit.signing_keys import load_private
    from schemas.note import is_key_name

    if receipt is None:
        if key is not None or name is not None:
            raise typer.BadParameter("--receipt-key and --receipt-name sign a --receipt FILE: name the file too")
        return None
    if key is None or name is None:
        raise typer.BadParameter("--receipt needs --receipt-key (your private key) and --receipt-name (its name)")
    if not is_key_name(name):
        raise typer.BadParameter(f"--receipt-name {name[:80]!r}: a key name is printable, with no space or '+'")
    return name, load_private(key)


def _write_receipt(path: Path, signer: tuple[str, bytes], bundles: Sequence[bytes], done: Sequence[Reexecuted]) -> None:
    from schemas import sha256_hex
    from schemas.note import sign_note
    from schemas.receipt import Receipt, ReceiptLine

    lines = tuple(
        ReceiptLine(
            sha256_hex(data), one.envelope.request_id, "reproduced" if one.reproduced else "not-reproduced",
            len(one.result.replayed.token_ids), one.result.event.lane_fingerprint_sha256,
        )
        for data, one in zip(bundles, done, strict=True)
    )  # fmt: skip
    name, private = signer
    path.write_bytes(sign_note(Receipt(datetime.now(UTC), lines).text(), name, private).encode())


@evidence_app.command("receipt")
def receipt_cmd(
    receipt: Annotated[Path, typer.Argument(help="a receipt that reexecute --receipt wrote")],
    key: Annotated[str, typer.Option("--key", help="the re-executor's verifier key (a C2SP vkey, or a file of one)")],
    bundles: Annotated[list[Path] | None, typer.Argument(help="bundles that must be in it")] = None,
) -> None:
    """Check a re-execution receipt: its signature under the re-executor's key, and which bundles it names.

    Example: reprolane audit evidence receipt receipt.note evidence.zip --key "example.org/regulator+1a2b3c4d+AX..."
    """
    from schemas import sha256_hex
    from schemas.note import parse_note, parse_vkey, verifies
    from schemas.receipt import parse_receipt

    text = Path(key).read_text() if Path(key).is_file() else key
    vkey = parse_vkey(text)
    try:
        note = parse_note(receipt.read_bytes())
    except OSError as exc:
        raise typer.BadParameter(f"{receipt}: {exc.strerror or exc}") from exc
    if not verifies(note, vkey):
        typer.echo(f"FAILED receipt {receipt}: not signed by {vkey.name}+{vkey.key_id:08x}")
        raise typer.Exit(1)
    signed = parse_receipt(note.text)
    typer.echo(f"verified receipt {receipt}: signed by {vkey.name}+{vkey.key_id:08x}, re-executed at {signed.at}")
    for one in signed.lines:
        typer.echo(
            f"  {one.request_id}: {one.verdict}, {one.tokens} tokens, runtime {one.lane_fingerprint_sha256[:12]}"
        )
    named = {one.bundle_sha256: one for one in signed.lines}
    missing: list[Path] = []
    for path in bundles or []:
        try:
            digest = sha256_hex(path.read_bytes())
        except OSError as exc:
            raise typer.BadParameter(f"{path}: {exc.strerror or exc}") from exc
        found = named.get(digest)
        if found is None:
            missing.append(path)
            typer.echo(f"  - {path}: NOT in the receipt")
        else:
            typer.echo(f"  - {path}: in the receipt ({found.request_id}, {found.verdict})")
    raise typer.Exit(1 if missing else 0)


def _text(done: Sequence[Reexecuted], engines: int) -> str:
    """The report a person reads: each bundle's check, then its verdict (a divergence shown as ``replay request``
    shows it); last, how many requests ran on how many engines."""
    from replayer.report import render_request

    lines: list[str] = []
    for one in done:
        lines += one.report.lines
        lines.append(
            f"reproduced bit for bit: request {one.envelope.request_id}, "
            f"{len(one.result.replayed.token_ids)} tokens and their logprobs, in its recorded schedule"
            if one.reproduced
            else f"NOT reproduced: request {one.envelope.request_id}\n"
            + render_request(one.envelope, one.result).rstrip("\n")
        )
    lines.append(f"{len(done)} request(s) re-executed on {engines} engine(s) started here")
    return "\n".join(lines)


def _json(files: Sequence[Path], done: Sequence[Reexecuted], engines: int) -> dict[str, Any]:
    """The ``--json`` document (module doc): `done` is in the order of `files`, as `reexecute_all` returns it."""
    return {
        "engines": engines,
        "requests": [
            {
                "bundle": str(path),
                "request_id": one.envelope.request_id,
                "reproduced": one.reproduced,
                "engine": one.engine,
                "result": one.result.model_dump(mode="json"),
            }
            for path, one in zip(files, done, strict=True)
        ],
    }
