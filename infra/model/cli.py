"""``reprolane model ...``: fetch the converted model into the cache, show or verify it."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from infra import paths
from infra.cli_options import CacheDirOpt
from infra.model.manifest import verify_model

model_app = typer.Typer(help="The served model (SmolLM2-135M-Instruct), converted and verified.", no_args_is_help=True)


@model_app.command()
def fetch(
    cache_dir: CacheDirOpt = None,
    force: Annotated[bool, typer.Option("--force", help="rebuild even if the cache verifies")] = False,
) -> None:
    """Download, convert and verify the model, or reuse the verified cache.

    Example: reprolane model fetch --cache-dir /cache
    """
    from infra.model.cache import ensure_model

    started = time.monotonic()
    manifest = ensure_model(cache_dir, force=force, report=typer.echo)
    typer.echo(f"{manifest.model_name} ready at {manifest.path} in {time.monotonic() - started:.1f} s")


@model_app.command()
def show(cache_dir: CacheDirOpt = None) -> None:
    """Verify the cached model and print its manifest as JSON.

    Example: reprolane model show --cache-dir /cache
    """
    manifest = verify_model(paths.model_dir(cache_dir))
    data = {"path": str(manifest.path), **manifest.model_dump(mode="json")}
    typer.echo(json.dumps(data, indent=2, sort_keys=True))


@model_app.command()
def verify(cache_dir: CacheDirOpt = None) -> None:
    """Re-hash every file of the cached model against its manifest (exit 1 when it does not match).

    Example: reprolane model verify --cache-dir /cache
    """
    manifest = verify_model(paths.model_dir(cache_dir))
    typer.echo(f"ok {manifest.path} model_sha256={manifest.model_sha256}")
