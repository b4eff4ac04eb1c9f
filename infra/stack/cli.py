"""``reprolane stack ...``: bring the local stack up, down, or report on it."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from infra.cli_options import CacheDirOpt, RunDirOpt
from infra.stack.launcher import LocalStack
from infra.stack.state import SERVER_ORDER, KafkaStorage, ServerName
from schemas.layout import ICEBERG_TABLE_BUCKET

stack_app = typer.Typer(help="The local stack: SeaweedFS (S3), Tansu (Kafka), vLLM CPU.", no_args_is_help=True)


@stack_app.command()
def up(
    run_dir: RunDirOpt = None,
    no_vllm: Annotated[bool, typer.Option("--no-vllm", help="start only S3 and Kafka")] = False,
    kafka_storage: Annotated[
        str, typer.Option("--kafka-storage", help="where Tansu keeps topics: s3 (survives restarts) or memory")
    ] = "s3",
    cache_dir: CacheDirOpt = None,
) -> None:
    """Start what is not running (no duplicates) and wait until every server answers.

    Example: reprolane stack up --no-vllm --kafka-storage memory
    """
    if kafka_storage not in ("s3", "memory"):
        raise typer.BadParameter(f"{kafka_storage!r} is not one of s3, memory", param_hint="--kafka-storage")
    storage: KafkaStorage = "s3" if kafka_storage == "s3" else "memory"
    servers: tuple[ServerName, ...] = tuple(n for n in SERVER_ORDER if not (no_vllm and n == "vllm"))
    started = time.monotonic()
    stack = LocalStack(run_dir, cache_dir=cache_dir, kafka_storage=storage, report=typer.echo)
    info = stack.up(servers)
    typer.echo(f"stack ready in {time.monotonic() - started:.1f} s (state: {info.run_dir / 'stack.json'})")
    typer.echo(f"  kafka  {info.kafka_bootstrap}  ({info.kafka_storage} storage)")
    typer.echo(f"  s3     {info.s3_endpoint}  buckets {info.audit_bucket} (object lock), {info.tansu_bucket}")
    if info.iceberg_url:
        typer.echo(f"  iceberg {info.iceberg_url}  REST catalog, warehouse s3://{ICEBERG_TABLE_BUCKET}/")
    if info.vllm_url:
        typer.echo(f"  vllm   {info.vllm_url}/v1  model {info.model_name}")


@stack_app.command()
def down(run_dir: RunDirOpt = None) -> None:
    """Stop every server (SIGTERM, then SIGKILL) and check that nothing is left.

    Example: reprolane stack down --run-dir .reprolane
    """
    started = time.monotonic()
    LocalStack(run_dir, report=typer.echo).down()
    typer.echo(f"down in {time.monotonic() - started:.1f} s")


@stack_app.command()
def status(run_dir: RunDirOpt = None) -> None:
    """Print each server's health, url and pid; exit 1 if any is not ready.

    Example: reprolane stack status --run-dir .reprolane
    """
    statuses = LocalStack(run_dir).status()
    for entry in statuses:
        typer.echo(f"{entry.name:<6} {entry.health:<8} {entry.url:<28} pid {entry.pid or '-'}")
        if entry.health == "dead":
            typer.echo(f"  last lines of {entry.log}:")
            for line in entry.log_tail.splitlines():
                typer.echo(f"  | {line}")
    if any(entry.health != "ready" for entry in statuses):
        raise typer.Exit(1)
