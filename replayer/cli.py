"""The replayer's command line: the typer sub-apps `infra.cli` registers as ``replay`` and ``replayer``, and
the ``show`` command.

    reprolane replay request REQUEST_ID [--lane schedule|vllm|remote|transformers] [--via auto|service|local]
                             [--json] [--timeout S] [--group-id G] [--kafka-bootstrap HOST:PORT] [--s3-endpoint URL ...]
    reprolane replay request --client-request-id ID --tenant T [same options]   (the newest envelope it names)
    reprolane replay workflow WORKFLOW_ID [--tenant T] [same options]  (steps of several tenants need --tenant)
    reprolane serve replayer [--lane ...] [--kafka-bootstrap HOST:PORT] [--group-id G] [--replay-all] [...]
    reprolane audit show REQUEST_ID | --client-request-id ID --tenant T [--json]   (the envelope as recorded)

``replay request`` and ``replay workflow`` ask a running replayer service when one is running
(`replayer.on_demand`: ``--via auto``), else replay here and say why in one line on stderr. Wherever a request is
replayed, its lane is chosen the one way (`replayer.lane_choice`: the schedule lane when its schedule is there,
unless ``--lane`` names one) and its result is stored where the console and evidence bundles read results (a
result stored already on that lane is the answer), so the same request gets the same verdict from every entry
point. With ``--json`` a command prints exactly one JSON document on
stdout and everything else, a lane's engine logs included, on stderr (`replayer.machine_output`); without it the
replay commands print their text report on stdout the same way, alone.

Settings come from ``REPROLANE_REPLAYER_*`` and are overridden by the options given (`replayer.cli_options`).
Exit codes of ``replay``: 0 when the target level held (every replayed step, for a workflow), 1 when it did not,
2 when no verdict could be reached: unknown id, bad arguments or settings, an envelope that cannot be replayed,
S3 or the lane unavailable. The commands raise (`replayer.errors`, ``typer.BadParameter``); the root of the
command line turns that into one line on stderr (``reprolane: error: ...``) and exit 2, never a traceback.

The apps are built by factories (`build_replay_app`, `build_replayer_app`) so tests can inject a lane factory
(a fake or perturbing lane) and a store factory without loading a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from replayer.cli_options import S3_OPTIONS, LaneFactory, StoreFactory, make_lane, settings_options
from replayer.errors import EnvelopeNotFoundError, NotReplayableError, StoreError
from replayer.lane_choice import ASKABLE, SCHEDULE_LANE, LaneChoice, keep
from replayer.machine_output import machine_output
from replayer.on_demand import DEFAULT_SERVICE_TIMEOUT_S, VIAS, replay_via_service
from replayer.prompt_text import decode_prompts
from replayer.report import WorkflowStep, first_diverging, render_request, render_workflow
from replayer.selection import not_replayable_reason
from replayer.settings import ReplayerSettings
from replayer.show import render_record
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayResult
from schemas.envelope import SIDECAR_REQUEST_ID_PREFIX, is_sidecar_request_id, is_valid_request_id

#: The settings options of ``replay request`` and ``replay workflow`` (their ``--lane`` is their own: it may name
#: the schedule lane, which is no setting).
REPLAY_OPTIONS = (*S3_OPTIONS, "model_dir", "remote_url")

RequestIdArg = Annotated[str | None, typer.Argument(help="the request id the sidecar recorded")]
ClientIdOpt = Annotated[
    str | None, typer.Option("--client-request-id", help="the client's X-Request-Id instead (with --tenant)")
]
TenantOpt = Annotated[
    str | None, typer.Option("--tenant", help="the tenant of --client-request-id, or whose workflow steps to replay")
]
WorkflowIdArg = Annotated[str, typer.Argument(help="the agent workflow id the sidecar recorded")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the replay result(s) as JSON")]
ViaOpt = Annotated[
    str,
    typer.Option("--via", help="service: the running replayer; local: a lane loaded here; auto: service if one runs"),
]
ServiceTimeoutOpt = Annotated[
    float, typer.Option("--timeout", min=0.1, help="seconds to wait for the replayer service's answer")
]
LaneOpt = Annotated[
    str | None,
    typer.Option(
        "--lane",
        help="schedule | vllm | remote | transformers (default: the schedule lane when the request's schedule is "
        "there, else the one-at-a-time lane of the settings)",
    ),
]


def _say(line: str) -> None:
    typer.echo(line, err=True)


def _asked(settings: ReplayerSettings, lane: str | None) -> tuple[ReplayerSettings, str | None]:
    """The settings and the lane asked for by ``--lane`` (None: the choice's own); a one-at-a-time lane's name
    becomes the settings' lane."""
    if lane is None or lane == SCHEDULE_LANE:
        return settings, lane
    if lane not in ASKABLE:
        raise typer.BadParameter(f"--lane must be one of {', '.join(ASKABLE)}, not {lane!r}")
    return settings.model_copy(update={"lane": lane}), lane


class _Replays:
    """One command's replays: the running service asked (``--via``), else a `LaneChoice` made here on first need,
    its lanes kept for the command's next envelopes; a result replayed here is stored (`keep`)."""

    def __init__(self, settings: ReplayerSettings, store: EnvelopeStore, lane_factory: LaneFactory,
                 lane: str | None, via: str, timeout_s: float) -> None:  # fmt: skip
        if via not in VIAS:
            raise typer.BadParameter(f"--via must be one of {', '.join(VIAS)}, not {via!r}")
        self.settings, self.store, self.lane, self.via, self.timeout_s = settings, store, lane, via, timeout_s
        self._lane_factory = lane_factory
        self._choice: LaneChoice | None = None

    def replay(self, envelope: Envelope) -> ReplayResult:
        if self.via != "local":
            args = (envelope, self.store, self.settings, self.via, self.timeout_s, _say)
            result = replay_via_service(*args, lane=self.lane)
            if result is not None:
                return result
            self.via = "local"  # --via auto, and the service failed: said once, the next envelopes replay here
        if self._choice is None:
            from replayer.schedule.replay import ScheduleReplayer

            make = self._lane_factory
            self._choice = LaneChoice(self.settings, lambda: make(self.settings), ScheduleReplayer(self.settings),
                                      say=lambda line: _say(f"reprolane: {line}"))  # fmt: skip
        replayed = self._choice.replay(envelope, lane=self.lane, stored=self.store.get_result)
        try:
            return keep(self.store, envelope, replayed)[0]
        except StoreError as exc:
            _say(f"reprolane: the result is not stored, so the console and evidence will not show it: {exc}")
            return replayed.result

    def close(self) -> None:
        if self._choice is not None:
            self._choice.close()


def build_replay_app(
    *, lane_factory: LaneFactory = make_lane, store_factory: StoreFactory = EnvelopeStore.from_settings
) -> typer.Typer:
    """The ``replay`` sub-app (see module docstring)."""
    app = typer.Typer(
        help="Replay recorded requests on a deterministic lane and report divergence.", add_completion=False
    )

    @app.command("request")
    @settings_options(*REPLAY_OPTIONS, "kafka_bootstrap", "group_id")
    def request(
        settings: ReplayerSettings,
        request_id: RequestIdArg = None,
        lane: LaneOpt = None,
        as_json: JsonOpt = False,
        client_request_id: ClientIdOpt = None,
        tenant: TenantOpt = None,
        via: ViaOpt = "auto",
        timeout_s: ServiceTimeoutOpt = DEFAULT_SERVICE_TIMEOUT_S,
    ) -> None:
        """Replay one recorded request and print what diverged (exit 0: target held, 1: not, 2: no verdict).

        With a replayer service running (its lanes loaded) the service replays it, in seconds; without one
        (``--via auto``, the default) a lane is loaded here, which takes a while, and stderr says why.

        Example: reprolane replay request rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375 --lane vllm --json
        """
        settings, asked = _asked(settings, lane)
        if (request_id is None) == (client_request_id is None) or (client_request_id is None) != (tenant is None):
            raise typer.BadParameter("give REQUEST_ID, or --client-request-id with --tenant")
        store = store_factory(settings)
        replays = _Replays(settings, store, lane_factory, asked, via, timeout_s)
        if client_request_id is not None and tenant is not None:
            envelope = store.find_by_client_request_id(tenant, client_request_id)[-1]
            request_id = envelope.request_id
        else:
            assert request_id is not None
            envelope = _by_request_id(request_id, store.get_by_request_id, "replay request")
        if not envelope.replayable:
            raise NotReplayableError(f"request {request_id} is not replayable: {not_replayable_reason(envelope)}")
        with machine_output(True) as document:  # the report, text or JSON, alone on stdout: a lane's logs on stderr
            try:
                result = replays.replay(envelope)
            finally:
                replays.close()
            document(result.model_dump_json(indent=2) if as_json else render_request(envelope, result).rstrip("\n"))
        raise typer.Exit(0 if result.event.target_met else 1)

    @app.command("workflow")
    @settings_options(*REPLAY_OPTIONS, "kafka_bootstrap", "group_id")
    def workflow(
        workflow_id: WorkflowIdArg,
        settings: ReplayerSettings,
        lane: LaneOpt = None,
        as_json: JsonOpt = False,
        tenant: TenantOpt = None,
        via: ViaOpt = "auto",
        timeout_s: ServiceTimeoutOpt = DEFAULT_SERVICE_TIMEOUT_S,
    ) -> None:
        """Replay every recorded step of a workflow in order; report the first step that diverges. Each step is
        replayed as ``replay request`` replays it (the service asked, the same lane chosen, the result stored).

        Example: reprolane replay workflow wf-7d1e0b2c --tenant acme --json
        """
        settings, asked = _asked(settings, lane)
        store = store_factory(settings)
        replays = _Replays(settings, store, lane_factory, asked, via, timeout_s)
        envelopes = store.list_workflow(workflow_id, tenant)
        steps: list[WorkflowStep] = []
        with machine_output(True) as document:  # as in `request`
            try:
                for envelope in envelopes:
                    if not envelope.replayable:
                        steps.append(WorkflowStep(envelope, None, not_replayable_reason(envelope)))
                        continue
                    steps.append(WorkflowStep(envelope, replays.replay(envelope)))
            finally:
                replays.close()
            first = first_diverging(steps)
            if as_json:
                document(json.dumps(_workflow_json(workflow_id, steps, first), indent=2, ensure_ascii=False))
            else:
                document(render_workflow(workflow_id, steps).rstrip("\n"))
        raise typer.Exit(1 if first is not None else 0)

    return app


def build_show_command(*, store_factory: StoreFactory = EnvelopeStore.from_settings) -> Callable[..., None]:
    """``reprolane audit show``: the envelope exactly as recorded (`replayer.show`)."""

    @settings_options(*S3_OPTIONS, "model_dir")
    def show(
        settings: ReplayerSettings,
        request_id: RequestIdArg = None,
        as_json: Annotated[
            bool, typer.Option("--json", help="print the envelope's canonical JSON (its sha256 is the envelope id)")
        ] = False,
        client_request_id: ClientIdOpt = None,
        tenant: Annotated[str | None, typer.Option("--tenant", help="the tenant of --client-request-id")] = None,
    ) -> None:
        """Show the envelope recorded for a request, checked against its content address (exit 2: not found).

        Example: reprolane audit show rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375 --json
        """
        if (request_id is None) == (client_request_id is None) or (client_request_id is None) != (tenant is None):
            raise typer.BadParameter("give REQUEST_ID, or --client-request-id with --tenant")
        store = store_factory(settings)
        if client_request_id is not None and tenant is not None:
            record = store.read_client_records(tenant, client_request_id)[-1]
        else:
            assert request_id is not None
            record = _by_request_id(request_id, store.read_record, "audit show")
        if not as_json:
            decoded = None if record.envelope is None else decode_prompts(record.envelope, settings.model_dir)
            typer.echo(render_record(record, store.bucket, decoded), nl=False)
            return
        if record.envelope is None:
            typer.echo(f"reprolane: request {record.request_id} is sealed and cannot be opened here "
                       f"({record.unopened}): printing the sealed record as stored", err=True)  # fmt: skip
        data = record.data if record.canonical is None else record.canonical  # a sealed record is JSON itself
        with machine_output(True) as document:
            document(data.decode("utf-8"))

    return show


_T = TypeVar("_T")


def _by_request_id(request_id: str, read: Callable[[str], _T], command: str) -> _T:
    """`read(request_id)`; when nothing is indexed under an id that is not of the sidecar's shape (``rl-`` and 32
    hex digits), the error says it may be the client's own X-Request-Id and how to ask for that."""
    try:
        return read(request_id)
    except EnvelopeNotFoundError as exc:
        if is_sidecar_request_id(request_id) or not is_valid_request_id(request_id):
            raise
        hint = (f"{exc}; {request_id!r} is not an id the sidecar mints ({SIDECAR_REQUEST_ID_PREFIX}<32 hex "
                f"digits): if it is the client's X-Request-Id, run `reprolane {command} --client-request-id "
                f"{request_id} --tenant TENANT`")  # fmt: skip
        raise EnvelopeNotFoundError(hint) from exc


def _workflow_json(workflow_id: str, steps: list[WorkflowStep], first: WorkflowStep | None) -> dict[str, Any]:
    def step_no(s: WorkflowStep) -> int | None:
        return s.envelope.workflow.step if s.envelope.workflow else None

    return {
        "workflow_id": workflow_id,
        "first_diverging_step": None if first is None else step_no(first),
        "steps": [
            {
                "step": step_no(s),
                "request_id": s.envelope.request_id,
                "skipped": s.skipped,
                "result": None if s.result is None else s.result.model_dump(mode="json"),
            }
            for s in steps
        ],
    }


def build_replayer_app(*, serve_fn: Callable[[ReplayerSettings], None] | None = None) -> typer.Typer:
    """The ``replayer`` sub-app: the long-running service."""
    app = typer.Typer(help="The replayer service (Kafka consumer).", add_completion=False)

    @app.callback()
    def _group() -> None:
        """The replayer service (Kafka consumer)."""

    @app.command("serve")
    @settings_options(
        "lane", "kafka_bootstrap", "group_id", "replay_all", "metrics_port", *S3_OPTIONS, "model_dir", "remote_url",
        "otel_endpoint",
    )  # fmt: skip
    def serve_cmd(settings: ReplayerSettings) -> None:
        """Consume envelopes, replay the flagged ones, publish divergence events (until SIGINT/SIGTERM).

        Example: reprolane serve replayer --lane vllm --flagged-only --metrics-port 9102
        """
        run = serve_fn
        if run is None:
            from replayer.service import serve

            run = serve
        run(settings)

    return app


replay_app = build_replay_app()
replayer_app = build_replayer_app()
show_command = build_show_command()
