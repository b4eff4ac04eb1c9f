"""What the replayer's commands share: their settings options, the settings those make, the default factories.

Every replayer command (``replay``, ``serve replayer``, ``matrix``, ``explain``, and infra's ``gate``) builds one
`ReplayerSettings` from the environment (``REPROLANE_REPLAYER_*``) overridden by the options given. Each such
option is written once, in `OPTIONS`, under the settings field it sets; `settings_options` gives a command the
ones it names and calls it with the settings they make (the way every service's commands do,
`infra.clients.settings_options`)::

    @settings_options("lane", *S3_OPTIONS)
    def replay(request_id: Annotated[str, typer.Argument()], settings: ReplayerSettings) -> None: ...

The command's ``settings`` parameter is replaced, in its signature (the one typer reads), by those options, in
that place; the command itself sees only the settings. Nothing here prints or exits: a bad ``--lane`` is a
``typer.BadParameter`` and a value that does not validate a ``pydantic.ValidationError``, which the root of the
command line (`infra.cli`) turns into one line and exit 2.

The lane and store factories are parameters of the command builders, so tests inject a fake lane and a moto
store; the defaults here import the lanes only when a lane is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from infra.clients.settings_options import CONNECTION_OPTIONS, Command
from infra.clients.settings_options import settings_options as shared_settings_options
from replayer.lane_choice import ONE_AT_A_TIME
from replayer.lanes.base import Lane
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore

LaneFactory = Callable[[ReplayerSettings], Lane]
StoreFactory = Callable[[ReplayerSettings], EnvelopeStore]

LANES = ONE_AT_A_TIME  # the lanes a service or a settings object runs; a command may also ask for `schedule`

#: Each settings option, under the `ReplayerSettings` field it sets (None: not given, the environment decides).
OPTIONS: dict[str, Any] = {
    "lane": Annotated[str | None, typer.Option("--lane", help=f"{' | '.join(LANES)} (default: settings)")],
    **CONNECTION_OPTIONS,
    "group_id": Annotated[str | None, typer.Option("--group-id", help="consumer group")],
    "replay_all": Annotated[bool | None, typer.Option("--replay-all/--flagged-only", help="replay every envelope")],
    "metrics_port": Annotated[int | None, typer.Option("--metrics-port", help="Prometheus port (127.0.0.1)")],
    "model_dir": Annotated[
        Path | None, typer.Option("--model-dir", help="HF model folder of the local lanes (default: the fetched cache)")
    ],
    "remote_url": Annotated[str | None, typer.Option("--remote-url", help="base URL of the remote lane")],
    "otel_endpoint": Annotated[
        str | None, typer.Option("--otel-endpoint", help="OTLP endpoint: a span per replay (default: none)")
    ],
}
S3_OPTIONS = ("s3_endpoint", "s3_access_key", "s3_secret_key", "s3_bucket")


def build_settings(**options: Any) -> ReplayerSettings:
    """Settings from the environment, overridden by the options that were given (None = not given).

    Raises ``typer.BadParameter`` for a ``--lane`` that is not one of `LANES` and ``pydantic.ValidationError``
    for any other value that does not validate."""
    lane = options.get("lane")
    if lane is not None and lane not in LANES:
        raise typer.BadParameter(f"--lane must be one of {', '.join(LANES)}, not {lane!r}")
    return ReplayerSettings(**{name: value for name, value in options.items() if value is not None})


def settings_options(*fields: str) -> Callable[[Command], Command]:
    """Give a command the options of `fields` (keys of `OPTIONS`) in place of its ``settings`` parameter, and call
    it with the settings they make (`infra.clients.settings_options`)."""
    return shared_settings_options(OPTIONS, build_settings, *fields)


def make_lane(settings: ReplayerSettings) -> Lane:
    """The lane of `settings` (the lanes, and what they import, are loaded only here)."""
    from replayer.lanes import make_lane as make

    return make(settings)
