"""``reprolane capture serve``: run the sidecar (registered by infra/cli.py as the ``capture`` sub-app).

Flags mirror `CaptureSettings`; a flag left out falls back to the environment (``REPROLANE_CAPTURE_*``) and
then to the default. `build_settings` and `serve` are the programmatic entry points (infra wires
``--stack-dir`` on top of them; capture never imports infra).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from pydantic import ValidationError

from capture.app import build_app
from capture.auth import load_key_file, new_key
from capture.errors import CaptureError
from capture.http_server import uvicorn_config
from capture.ledger.key_file import write_key_file
from capture.metrics import CaptureMetrics
from capture.publisher import Publisher
from capture.settings import CaptureSettings
from capture.spool import Spool
from schemas import ContractError

log = logging.getLogger("capture")

capture_app = typer.Typer(name="capture", help="The capture sidecar.", no_args_is_help=True, add_completion=False)


@capture_app.callback()
def _group() -> None:
    """The capture sidecar (a group even with one command, so ``capture serve`` keeps its name)."""


def _json_flag(flag: str, value: str | None) -> Any:
    """A flag given as JSON, parsed (None when not given); `CaptureError` naming the flag when it is not JSON."""
    if value is None:
        return None
    try:
        return json.loads(value)
    except ValueError as exc:
        raise CaptureError(f"{flag}: not JSON: {exc}") from None


def _lora_modules(values: list[str] | None) -> dict[str, Path] | None:
    """``--lora-module NAME=PATH`` flags (vLLM's ``--lora-modules`` syntax) as the setting; None when not given."""
    if not values:
        return None
    out: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise CaptureError(f"--lora-module {value!r}: expected NAME=PATH")
        if name in out:
            raise CaptureError(f"--lora-module: adapter {name!r} given twice")
        out[name] = Path(path)
    return out


def build_settings(**flags: Any) -> CaptureSettings:
    """Settings from flags (``None`` = not given: environment, then default). Raises CaptureError naming fields."""
    given = {name: value for name, value in flags.items() if value is not None and value != ()}
    try:
        return CaptureSettings(**given)
    except ValidationError as exc:
        raise CaptureError(str(ContractError.from_validation("capture settings", exc))) from exc


def build_spool(settings: CaptureSettings, metrics: CaptureMetrics | None = None) -> Spool:
    """The sidecar's spool, per its settings (best_effort lingers before each fsync; guaranteed does not)."""
    return Spool(
        settings.spool_dir,
        max_bytes=settings.spool_max_bytes,
        warn_ratio=settings.spool_warn_ratio,
        group_commit_ms=settings.group_commit_ms,
        linger_ms=settings.best_effort_linger_ms if settings.mode == "best_effort" else 0.0,
        metrics=metrics,
    )


def serve(settings: CaptureSettings) -> None:
    """Run the sidecar until interrupted (uvloop when installed; the HTTP parser and the bounds of the edge as
    `capture.http_server.uvicorn_config` sets them from `settings`).

    uvicorn, because nothing measured cheaper for this app: granian (ASGI, one worker, uvloop, pinned to the same
    core) spent more CPU per captured request (BENCHMARKS.md "Capture sidecar" has the figures).
    """
    metrics = CaptureMetrics()
    spool = build_spool(settings, metrics)
    publisher: Publisher | None = None
    if settings.kafka_bootstrap or settings.s3_endpoint:
        publisher = Publisher(spool, settings, metrics)
    else:
        log.warning("no --kafka-bootstrap and no --s3-endpoint: envelopes stay in the spool %s", settings.spool_dir)
    app = build_app(settings, spool=spool, metrics=metrics, publisher=publisher)
    config = uvicorn_config(app, settings, app.state.proxy.auth)  # the app's own judge of keys serves keyed first
    tune_gc()
    uvicorn.Server(config).run()  # run(), not asyncio.run(serve()): only run() applies loop="auto" (uvloop)


# Young-generation size of the garbage collector while serving (CPython's default is 700).
GC_GEN0_THRESHOLD = 20_000


def tune_gc() -> None:
    """Garbage-collector settings for serving (measured, see BENCHMARKS.md "Capture sidecar").

    A request allocates hundreds of container objects (upstream's parsed answer, the collected logprobs) and
    dozens of requests are in flight at once. With the default thresholds the collector ran a young collection every
    request and a full one every few hundred, each walking everything alive: a large share of the sidecar's CPU per
    request under load (the figures are in BENCHMARKS.md). Freezing what exists at start-up (modules, settings,
    the app) takes it out of every collection for good, and a larger young generation makes collections rarer
    (each costs about the same: it walks the requests in flight). Cycles are still collected; memory stays flat
    (the benchmark's memory phase checks it).
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


@capture_app.command("serve")
def serve_command(
    upstream: Annotated[str | None, typer.Option(help="base URL of the OpenAI-compatible server")] = None,
    host: Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8100)")] = None,
    mode: Annotated[str | None, typer.Option(help="guaranteed | best_effort")] = None,
    spool_dir: Annotated[Path | None, typer.Option(help="spool directory")] = None,
    spool_max_bytes: Annotated[int | None, typer.Option(help="spool byte bound")] = None,
    max_body_bytes: Annotated[int | None, typer.Option(help="larger request bodies get 413")] = None,
    upstream_timeout_s: Annotated[float | None, typer.Option(help="upstream timeout in seconds")] = None,
    kafka_bootstrap: Annotated[str | None, typer.Option(help="Kafka bootstrap servers")] = None,
    s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL")] = None,
    s3_bucket: Annotated[str | None, typer.Option(help="audit bucket (Object Lock)")] = None,
    s3_access_key: Annotated[str | None, typer.Option(help="S3 access key")] = None,
    s3_secret_key: Annotated[str | None, typer.Option(help="S3 secret key (prefer the environment)")] = None,
    s3_processes: Annotated[int | None, typer.Option(help="worker processes for S3 PUTs (0: threads)")] = None,
    manifest: Annotated[Path | None, typer.Option(help="reprolane-manifest.json of the served model")] = None,
    runtime_file: Annotated[Path | None, typer.Option(help="JSON of runtime fields the sidecar cannot see")] = None,
    lora_module: Annotated[
        list[str] | None, typer.Option(help="an adapter upstream serves, NAME=PATH as its --lora-modules (repeatable)")
    ] = None,
    audit_top_logprobs: Annotated[int | None, typer.Option(help="top-k logprobs recorded per step")] = None,
    inject_seed: Annotated[
        bool | None,
        typer.Option(help="add a seed to sampled requests without one (default: in guaranteed mode only)"),
    ] = None,
    upstream_generation_config: Annotated[
        str | None, typer.Option(help="upstream vLLM's --generation-config: auto (default) | vllm")
    ] = None,
    upstream_override_generation_config: Annotated[
        str | None, typer.Option(help="upstream vLLM's --override-generation-config, the same JSON")
    ] = None,
    refuse_uncaptured: Annotated[
        bool | None, typer.Option(help="403 for writes on paths not captured (/v1/responses, ...)")
    ] = None,
    flag_tenant: Annotated[list[str] | None, typer.Option(help="flag this tenant's requests (repeatable)")] = None,
    sample_rate: Annotated[float | None, typer.Option(help="fraction of requests flagged for replay")] = None,
    sidecar_id: Annotated[str | None, typer.Option(help="name recorded in every envelope")] = None,
    schedule_recorder: Annotated[
        str | None, typer.Option(help="upstream records its schedule (name of the recorder): envelopes point at it")
    ] = None,
    auth_mode: Annotated[
        str | None, typer.Option(help="keys (default) | anonymous-allowed | trusted-proxy | off (local dev only)")
    ] = None,
    api_keys_path: Annotated[Path | None, typer.Option(help="the API key file (`capture add-key` writes it)")] = None,
    trusted_proxy: Annotated[
        list[str] | None, typer.Option(help="trusted-proxy mode: a network (CIDR) whose headers are trusted")
    ] = None,
    shadow_upstream: Annotated[
        str | None, typer.Option(help="candidate server: a sample of requests is sent again there (shadow)")
    ] = None,
    shadow_sample: Annotated[float | None, typer.Option(help="share of requests shadowed (0..1)")] = None,
    otel_endpoint: Annotated[
        str | None, typer.Option(help="OTLP endpoint: a span per captured request (default: none; OTEL_* honoured)")
    ] = None,
    otel_protocol: Annotated[str | None, typer.Option(help="http/protobuf (default) | grpc")] = None,
) -> None:
    """Serve the capture sidecar in front of --upstream."""
    try:
        settings = build_settings(
            upstream=upstream, host=host, port=port, mode=mode, spool_dir=spool_dir, spool_max_bytes=spool_max_bytes,
            max_body_bytes=max_body_bytes, upstream_timeout_s=upstream_timeout_s, kafka_bootstrap=kafka_bootstrap,
            s3_endpoint=s3_endpoint, s3_bucket=s3_bucket, s3_access_key=s3_access_key, s3_secret_key=s3_secret_key,
            s3_processes=s3_processes, manifest_path=manifest, runtime_path=runtime_file,
            lora_modules=_lora_modules(lora_module),
            audit_top_logprobs=audit_top_logprobs, inject_seed=inject_seed,
            upstream_generation_config=upstream_generation_config,
            upstream_override_generation_config=_json_flag(
                "--upstream-override-generation-config", upstream_override_generation_config
            ),
            refuse_uncaptured=refuse_uncaptured, flag_tenants=tuple(flag_tenant) if flag_tenant else None,
            sample_rate=sample_rate, sidecar_id=sidecar_id, schedule_recorder=schedule_recorder, auth_mode=auth_mode,
            api_keys_path=api_keys_path,
            trusted_proxies=tuple(trusted_proxy) if trusted_proxy else None,
            shadow_upstream=shadow_upstream, shadow_sample=shadow_sample,
            otel_endpoint=otel_endpoint, otel_protocol=otel_protocol,
        )  # fmt: skip
    except CaptureError as exc:  # a flag (or REPROLANE_CAPTURE_* value) that does not validate: bad input, exit 2
        raise typer.BadParameter(str(exc)) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call otherwise
    serve(settings)  # a CaptureError (unreadable manifest, spool held by another process) is exit 1 (infra.cli)


@capture_app.command("schedules")
def schedules_command(
    schedule_dir: Annotated[
        Path | None, typer.Option(help="the recorder's directory (default: $REPROLANE_SCHEDULE_DIR)")
    ] = None,
    kafka_bootstrap: Annotated[str | None, typer.Option(help="Kafka bootstrap servers")] = None,
    s3_endpoint: Annotated[str | None, typer.Option(help="S3 endpoint URL")] = None,
    s3_bucket: Annotated[str | None, typer.Option(help="audit bucket (Object Lock)")] = None,
    s3_access_key: Annotated[str | None, typer.Option(help="S3 access key")] = None,
    quarantine_dir: Annotated[Path | None, typer.Option(help="where refused segments go")] = None,
    poll_s: Annotated[float | None, typer.Option(help="seconds between looks at an idle directory")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port (0: none)")] = None,
    once: Annotated[bool, typer.Option(help="ship what is closed now, then exit")] = False,
) -> None:
    """Ship the engine's schedule log: closed segments to S3 and Kafka, at least once (runs beside vLLM)."""
    from capture.schedule.shipper import Shipper
    from capture.schedule.shipper_settings import ShipperSettings

    given: dict[str, Any] = {
        "schedule_dir": schedule_dir, "kafka_bootstrap": kafka_bootstrap, "s3_endpoint": s3_endpoint,
        "s3_bucket": s3_bucket, "s3_access_key": s3_access_key, "quarantine_dir": quarantine_dir, "poll_s": poll_s,
        "metrics_port": metrics_port,
    }  # fmt: skip
    try:
        settings = ShipperSettings(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as exc:
        raise typer.BadParameter(str(ContractError.from_validation("shipper settings", exc))) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_ship(Shipper(settings), once=once))


async def _ship(shipper: Any, *, once: bool) -> None:
    """Run `shipper` until SIGTERM or SIGINT (or, `once`, until the closed segments are shipped)."""
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, shipper.stop)
    try:
        if once:
            handled = await shipper.ship_pending()
            typer.echo(f"shipped {shipper.shipped} segments ({shipper.shipped_bytes} bytes), quarantined "
                       f"{shipper.quarantined} of {handled}")  # fmt: skip
        else:
            await shipper.run()
    finally:
        await shipper.close()


@capture_app.command("add-key")
def add_key_command(
    keys_file: Annotated[Path, typer.Argument(help="the key file (created 0600 when missing)")],
    key_id: Annotated[str, typer.Option("--id", help="the key's id ([A-Za-z0-9-], unique in the file)")],
    tenant: Annotated[str, typer.Option(help="the tenant every request with this key is recorded under")],
    role: Annotated[list[str] | None, typer.Option(help="capture (default) and/or flag (repeatable)")] = None,
) -> None:
    """Mint an API key: its hashed entry is added to KEYS_FILE, the key itself printed once (store it now)."""
    entries = load_key_file(keys_file, field="KEYS_FILE") if keys_file.exists() else {}
    if key_id in entries:
        raise typer.BadParameter(f"--id {key_id!r} is already in {keys_file}")
    key, entry = new_key(key_id, tenant, role or ("capture",))
    write_key_file(keys_file, [*(e.as_entry() for e in entries.values()), entry])
    typer.echo(key)
