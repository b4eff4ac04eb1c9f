"""``reprolane keys operator``, and the ``--operator-key-file`` option every state-changing command takes.

    reprolane keys operator KEYS_FILE --id ID --role R [--role R2] [--tenant T] [--key-output FILE]

mirrors ``reprolane keys api``: the hashed entry is added to KEYS_FILE (created 0600), the key itself is
printed once, or written to ``--key-output`` (created 0600) so that it never reaches a terminal. The commands that
act for an operator (`capture.audit.operators`) take ``--operator-key-file FILE`` (or
``REPROLANE_OPERATOR_KEY_FILE`` / ``REPROLANE_OPERATOR_KEY``): never the key itself as an argument.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from capture.audit.operators import OPERATOR_KEYS, OperatorGate, OperatorSettings
from capture.ledger.errors import KeyFileError
from capture.ledger.key_file import load_key_file, new_key, write_key_file
from capture.ledger.store import LedgerStore
from schemas.access_log import OPERATOR_ROLES

OperatorKeyFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--operator-key-file",
        help="file holding your operator key (else REPROLANE_OPERATOR_KEY_FILE or REPROLANE_OPERATOR_KEY)",
    ),
]

operator_app = typer.Typer(name="operator", no_args_is_help=True, add_completion=False, help="Operator keys.")


def operator_gate(store: LedgerStore, key_file: Path | None) -> OperatorGate:
    """The gate of one command: the key store and the caller's key from `OperatorSettings`, `key_file` first."""
    return OperatorGate(store, OperatorSettings(), key_file)


@operator_app.command("add-key")
def add_key_command(
    keys_file: Annotated[Path, typer.Argument(help="the operator key store (created 0600 when missing)")],
    key_id: Annotated[str, typer.Option("--id", help="the key's id ([A-Za-z0-9-], unique in the file)")],
    role: Annotated[list[str], typer.Option(help=f"one of {', '.join(sorted(OPERATOR_ROLES))} (repeatable)")],
    tenant: Annotated[
        str | None, typer.Option(help="act on this tenant's records only (default: every tenant)")
    ] = None,
    key_out: Annotated[
        Path | None, typer.Option("--key-output", help="write the key to this file (0600) instead of printing it")
    ] = None,
) -> None:
    """Mint an operator key: its hashed entry is added to KEYS_FILE, the key itself shown once (store it now).

    Example: reprolane keys operator operator-keys.json --id alice --role viewer --key-output alice.key
    """
    try:
        entries = load_key_file(keys_file, OPERATOR_KEYS, field="KEYS_FILE") if keys_file.exists() else {}
        if key_id in entries:
            raise typer.BadParameter(f"--id {key_id!r} is already in {keys_file}")
        key, entry = new_key(OPERATOR_KEYS, key_id, tenant, role)
    except KeyFileError as exc:  # a bad id, tenant or role, or a key store that cannot be trusted: bad input
        raise typer.BadParameter(str(exc)) from exc
    if key_out is not None:
        write_private_text(key_out, key + "\n")
    write_key_file(keys_file, [*(e.as_entry() for e in entries.values()), entry])
    if key_out is None:
        typer.echo(key)
    else:
        typer.echo(f"operator key {key_id} written to {key_out}")


def write_private_text(path: Path, text: str) -> None:
    """Create `path` readable by its owner only (0600) holding `text`; an existing file is refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise typer.BadParameter(f"--key-output {path} already exists") from None
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)
