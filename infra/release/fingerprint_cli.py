"""``reprolane release fingerprint``: the environment fingerprint as JSON, ``fingerprint diff A B``, and ``fingerprint
history`` (the known-good environments release gates passed, `infra.release.known_good`).

``diff`` exits like diff(1): 0 identical, 1 different (a verdict); a file that does not read or decode is bad
input (``typer.BadParameter``, exit 2), and a fingerprint that cannot be taken a `FingerprintError` (exit 1, by
the root of the command line).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from infra import paths
from infra.cli_options import deployment_name, read_fingerprint
from infra.release.fingerprint import local_environment, upstream_environment
from infra.release.known_good import KnownGoodStore, describe
from replayer.cli_options import build_settings
from schemas import diff_environments
from schemas.known_good import DEFAULT_DEPLOYMENT

fingerprint_app = typer.Typer(
    help="Environment fingerprint: model/tokenizer/template sha256, engine, torch, CUDA, device, topology.\n\n"
    "Example: reprolane release fingerprint --upstream http://127.0.0.1:8000 -o env.json",
    invoke_without_command=True,
)


@fingerprint_app.callback()
def take(
    ctx: typer.Context,
    model_dir: Annotated[
        Path | None, typer.Option("--model-dir", help="converted model dir (default: the cache)")
    ] = None,
    upstream: Annotated[str | None, typer.Option("--upstream", help="fingerprint a running server")] = None,
    runtime_file: Annotated[
        Path | None, typer.Option("--runtime-file", help="JSON of declared RuntimeFingerprint fields")
    ] = None,
    out: Annotated[Path | None, typer.Option("-o", "--output", help="write the JSON here too")] = None,
) -> None:
    """Print this environment's fingerprint (JSON)."""
    if ctx.invoked_subcommand is not None:
        return
    model = model_dir if model_dir is not None else paths.model_dir()
    fp = (
        upstream_environment(upstream, model_dir=model, runtime_file=runtime_file)
        if upstream
        else local_environment(model, runtime_file)
    )
    text = fp.model_dump_json(indent=2)
    if out is not None:
        out.write_text(text + "\n", encoding="utf-8")
    typer.echo(text)
    typer.echo(f"environment sha256: {fp.sha256()}", err=True)


@fingerprint_app.command()
def diff(
    a: Annotated[Path, typer.Argument(help="baseline fingerprint JSON")],
    b: Annotated[Path, typer.Argument(help="candidate fingerprint JSON")],
) -> None:
    """Fields that differ between two fingerprints; exit 0 when none, 1 when any (like diff(1)).

    Example: reprolane release fingerprint diff baseline.json candidate.json
    """
    fa, fb = read_fingerprint(a, "baseline"), read_fingerprint(b, "candidate")
    diffs = diff_environments(fa, fb)
    if not diffs:
        typer.echo(f"identical environments ({fa.sha256()[:16]})")
        raise typer.Exit(0)
    width = max(len(d.field) for d in diffs)
    typer.echo(f"{'field':<{width}}  baseline -> candidate")
    for d in diffs:
        typer.echo(f"{d.field:<{width}}  {d.recorded!r} -> {d.replayed!r}")
    raise typer.Exit(1)


@fingerprint_app.command()
def history(
    deployment: Annotated[
        str, typer.Option("--deployment", help="whose known-good history", callback=deployment_name)
    ] = DEFAULT_DEPLOYMENT,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="the newest N")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON document on stdout")] = False,
) -> None:
    """Known-good environments, newest first: every environment a release gate passed (the rollback targets).

    Read from the audit bucket of the replayer's S3 settings (``REPROLANE_REPLAYER_S3_*``, or the running
    stack); a record that does not match its key is listed as rejected, never as a target.

    Example: reprolane release fingerprint history --deployment prod --limit 5 --json
    """
    found = KnownGoodStore.from_settings(build_settings()).history(deployment, limit=limit)
    if as_json:
        doc = {
            "deployment": deployment,
            "records": [r.model_dump(mode="json") for r in found.records],
            "rejected": [{"key": key, "reason": why} for key, why in found.rejected],
        }
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
        return
    if not found.records:
        typer.echo(f"no known-good environment recorded for deployment {deployment!r}")
    for record in found.records:
        typer.echo(describe(record))
    for key, why in found.rejected:
        typer.echo(f"rejected {key}: {why}", err=True)
