"""``reprolane serve capture``: run the sidecar (registered by infra/cli/root.py as the ``capture`` sub-app).

Flags mirror `CaptureSettings`; a flag left out falls back to the environment (``REPROLANE_CAPTURE_*``) and
then to the default. `build_settings` and `serve` are the programmatic entry points (infra wires
``--stack-dir`` on top of them; capture never imports infra).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import uvicorn
from pydantic import ValidationError

from capture.errors import CaptureError
from capture.ledger.key_file import write_key_file
from capture.metrics import CaptureMetrics
from capture.publishing.publisher import Publisher
from capture.request.app import build_app
from capture.request.auth import load_key_file, new_key
from capture.request.http_server import uvicorn_config
from capture.schedule.shipper_settings import ShipperSettings
from capture.settings import CaptureSettings
from capture.spool import Spool
from infra.clients.settings_options import CONNECTION_OPTIONS, settings_options
from schemas import ContractError

log = logging.getLogger("capture")

capture_app = typer.Typer(name="capture", help="The capture sidecar.", no_args_is_help=True, add_completion=False)


@capture_app.callback()
def _group() -> None:
    """The capture sidecar (a group even with one command, so ``serve capture`` keeps its name)."""


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
    `capture.request.http_server.uvicorn_config` sets them from `settings`).

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


def _tuple(values: list[str] | None) -> tuple[str, ...] | None:
    return tuple(values) if values else None


#: Each ``serve capture`` option, under the `CaptureSettings` field it sets (None: not given, the environment
#: decides), written once (`infra.clients.settings_options`).
OPTIONS: dict[str, Any] = {
    "upstream": Annotated[str | None, typer.Option("--upstream", help="base URL of the OpenAI-compatible server")],
    "host": Annotated[str | None, typer.Option("--host", help="bind address (default 127.0.0.1)")],
    "port": Annotated[int | None, typer.Option("--port", help="port (default 8100)")],
    "mode": Annotated[str | None, typer.Option("--mode", help="guaranteed | best_effort")],
    "spool_dir": Annotated[Path | None, typer.Option("--spool-dir", help="spool directory")],
    "spool_max_bytes": Annotated[int | None, typer.Option("--spool-max-bytes", help="spool byte bound")],
    "max_body_bytes": Annotated[int | None, typer.Option("--max-body-bytes", help="larger request bodies get 413")],
    "upstream_timeout_s": Annotated[
        float | None, typer.Option("--upstream-timeout-s", help="upstream timeout in seconds")
    ],
    **CONNECTION_OPTIONS,
    "s3_processes": Annotated[
        int | None, typer.Option("--s3-processes", help="worker processes for S3 PUTs (0: threads)")
    ],
    "manifest_path": Annotated[
        Path | None, typer.Option("--manifest", help="reprolane-manifest.json of the served model")
    ],
    "runtime_path": Annotated[
        Path | None, typer.Option("--runtime-file", help="JSON of runtime fields the sidecar cannot see")
    ],
    "lora_modules": Annotated[
        list[str] | None,
        typer.Option("--lora-module", help="an adapter upstream serves, NAME=PATH as its --lora-modules (repeatable)"),
    ],
    "audit_top_logprobs": Annotated[
        int | None, typer.Option("--audit-top-logprobs", help="top-k logprobs recorded per step")
    ],
    "inject_seed": Annotated[
        bool | None,
        typer.Option(
            "--inject-seed/--no-inject-seed",
            help="add a seed to sampled requests without one (default: in guaranteed mode only)",
        ),
    ],
    "upstream_generation_config": Annotated[
        str | None,
        typer.Option("--upstream-generation-config", help="upstream vLLM's --generation-config: auto (default) | vllm"),
    ],
    "upstream_override_generation_config": Annotated[
        str | None,
        typer.Option(
            "--upstream-override-generation-config", help="upstream vLLM's --override-generation-config, the same JSON"
        ),
    ],
    "refuse_uncaptured": Annotated[
        bool | None,
        typer.Option(
            "--refuse-uncaptured/--no-refuse-uncaptured",
            help="403 for writes on paths not captured (/v1/responses, ...)",
        ),
    ],
    "flag_tenants": Annotated[
        list[str] | None, typer.Option("--flag-tenant", help="flag this tenant's requests (repeatable)")
    ],
    "sample_rate": Annotated[
        float | None, typer.Option("--sample-rate", help="fraction of requests flagged for replay")
    ],
    "sidecar_id": Annotated[str | None, typer.Option("--sidecar-id", help="name recorded in every envelope")],
    "engine_key": Annotated[
        str | None,
        typer.Option("--engine-key", help="the engine behind --upstream: the Kafka key of every envelope"),
    ],
    "schedule_recorder": Annotated[
        str | None,
        typer.Option(
            "--schedule-recorder", help="upstream records its schedule (name of the recorder): envelopes point at it"
        ),
    ],
    "auth_mode": Annotated[
        str | None,
        typer.Option("--auth-mode", help="keys (default) | anonymous-allowed | trusted-proxy | off (local dev only)"),
    ],
    "api_keys_path": Annotated[
        Path | None, typer.Option("--api-keys-path", help="the API key file (`keys api` writes it)")
    ],
    "trusted_proxies": Annotated[
        list[str] | None,
        typer.Option("--trusted-proxy", help="trusted-proxy mode: a network (CIDR) whose headers are trusted"),
    ],
    "shadow_upstream": Annotated[
        str | None,
        typer.Option("--shadow-upstream", help="candidate server: a sample of requests is sent again there (shadow)"),
    ],
    "shadow_sample": Annotated[float | None, typer.Option("--shadow-sample", help="share of requests shadowed (0..1)")],
    "otel_endpoint": Annotated[
        str | None,
        typer.Option(
            "--otel-endpoint", help="OTLP endpoint: a span per captured request (default: none; OTEL_* honoured)"
        ),
    ],
    "otel_protocol": Annotated[str | None, typer.Option("--otel-protocol", help="http/protobuf (default) | grpc")],
}

#: How an option's value becomes its setting, where the flag's form is not the setting's.
FLAG_VALUES: dict[str, Callable[[Any], Any]] = {
    "lora_modules": _lora_modules,
    "upstream_override_generation_config": functools.partial(_json_flag, "--upstream-override-generation-config"),
    "flag_tenants": _tuple,
    "trusted_proxies": _tuple,
}


def settings_from_flags(**flags: Any) -> CaptureSettings:
    """`build_settings` from ``serve capture``'s options; a value that does not validate is bad input (exit 2)."""
    try:
        return build_settings(**{name: FLAG_VALUES.get(name, _same)(value) for name, value in flags.items()})
    except CaptureError as exc:  # a flag (or REPROLANE_CAPTURE_* value) that does not validate
        raise typer.BadParameter(str(exc)) from exc


def _same(value: Any) -> Any:
    return value


@capture_app.command("serve")
@settings_options(OPTIONS, settings_from_flags, *OPTIONS)
def serve_command(settings: CaptureSettings) -> None:
    """Serve the capture sidecar in front of --upstream.

    Example: reprolane serve capture --upstream http://127.0.0.1:8000 --port 8100 --mode guaranteed
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream call otherwise
    serve(settings)  # a CaptureError (unreadable manifest, spool held by another process) is exit 1 (infra.cli)


#: Each ``serve schedules`` option, under the `ShipperSettings` field it sets (None: not given), written once.
SHIPPER_OPTIONS: dict[str, Any] = {
    "schedule_dir": Annotated[
        Path | None, typer.Option("--schedule-dir", help="the recorder's directory (default: $REPROLANE_SCHEDULE_DIR)")
    ],
    **CONNECTION_OPTIONS,
    "quarantine_dir": Annotated[Path | None, typer.Option("--quarantine-dir", help="where refused segments go")],
    "poll_s": Annotated[float | None, typer.Option("--poll-s", help="seconds between looks at an idle directory")],
    "metrics_port": Annotated[int | None, typer.Option("--metrics-port", help="Prometheus /metrics port (0: none)")],
}


def shipper_settings(**flags: Any) -> ShipperSettings:
    """`ShipperSettings` from ``serve schedules``' options (None: the environment, then the default); a value that
    does not validate is bad input (exit 2)."""
    try:
        return ShipperSettings(**{name: value for name, value in flags.items() if value is not None})
    except ValidationError as exc:
        raise typer.BadParameter(str(ContractError.from_validation("shipper settings", exc))) from exc


@capture_app.command("schedules")
@settings_options(SHIPPER_OPTIONS, shipper_settings, *SHIPPER_OPTIONS)
def schedules_command(
    settings: ShipperSettings, once: Annotated[bool, typer.Option(help="ship what is closed now, then exit")] = False
) -> None:
    """Ship the engine's schedule log: closed segments to S3 and Kafka, at least once (runs beside vLLM).

    Example: reprolane serve schedules --schedule-dir /var/lib/reprolane/schedule-log/segments --once
    """
    from capture.schedule.shipper import Shipper

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
    """Mint an API key: its hashed entry is added to KEYS_FILE, the key itself printed once (store it now).

    Example: reprolane keys api infra/secrets/capture_api_keys.json --id app-1 --tenant acme
    """
    entries = load_key_file(keys_file, field="KEYS_FILE") if keys_file.exists() else {}
    if key_id in entries:
        raise typer.BadParameter(f"--id {key_id!r} is already in {keys_file}")
    key, entry = new_key(key_id, tenant, role or ("capture",))
    write_key_file(keys_file, [*(e.as_entry() for e in entries.values()), entry])
    typer.echo(key)
