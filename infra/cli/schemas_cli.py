"""``reprolane schemas export DIR``: JSON Schema of the contract for consumers not written in Python."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from schemas.export import json_schemas

schemas_app = typer.Typer(help="The contract (envelopes, divergence events, fingerprints).", no_args_is_help=True)


@schemas_app.command()
def export(directory: Annotated[Path, typer.Argument(help="where to write the *.schema.json files")]) -> None:
    """Write one JSON Schema (draft 2020-12) per contract record into DIRECTORY.

    Example: reprolane schemas export schemas/json
    """
    if directory.exists() and not directory.is_dir():
        raise typer.BadParameter(f"{directory} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    for name, doc in json_schemas().items():
        (directory / name).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        typer.echo(str(directory / name))
