"""The replayer's command line: the typer sub-apps `infra.cli` registers as ``replay`` and ``replayer``, and
the ``show`` command.

    reprolane replay request REQUEST_ID [--lane vllm|remote|transformers] [--via auto|service|local] [--json]
                             [--timeout S] [--group-id G] [--kafka-bootstrap HOST:PORT] [--s3-endpoint URL ...]
    reprolane replay request --client-request-id ID --tenant T [same options]   (the newest envelope it names)
    reprolane replay workflow WORKFLOW_ID [--tenant T] [same options]  (steps of several tenants need --tenant)
    reprolane replayer serve [--lane ...] [--kafka-bootstrap HOST:PORT] [--group-id G] [--replay-all] [...]
    reprolane show REQUEST_ID | --client-request-id ID --tenant T [--json]   (the envelope as recorded)

``replay request`` asks a running replayer service when one is running (`replayer.on_demand`: ``--via auto``),
else loads the lane here and says so on stderr. With ``--json`` a command prints exactly one JSON document on
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
from typing import Annotated, Any

import typer

from replayer.cli_options import S3_OPTIONS, LaneFactory, StoreFactory, make_lane, settings_options
from replayer.errors import NotReplayableError
from replayer.lanes.base import Lane
from replayer.machine_output import machine_output
from replayer.on_demand import DEFAULT_SERVICE_TIMEOUT_S, VIAS, replay_via_service
from replayer.prompt_text import decode_prompts
from replayer.report import WorkflowStep, first_diverging, render_request, render_workflow
from replayer.selection import not_replayable_reason
from replayer.settings import ReplayerSettings
from replayer.show import render_record
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayResult

#: The settings options of ``replay request`` and ``replay workflow``.
REPLAY_OPTIONS = ("lane", *S3_OPTIONS, "model_dir", "remote_url")

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


def _replay(envelope: Envelope, lane: Lane, settings: ReplayerSettings) -> ReplayResult:
    from replayer.replay import replay_envelope

    return replay_envelope(envelope, lane, settings)


def _replay_scheduled(
    envelope: Envelope, settings: ReplayerSettings, say: Callable[[str], None]
) -> ReplayResult | None:
    """The schedule lane's replay when the envelope names a schedule that is found and complete (issue 22); None
    (after `say`-ing why, when it named one) for the one-at-a-time lane."""
    if envelope.schedule is None:
        return None
    from replayer.schedule_replay import ScheduleReplayer

    replayer = ScheduleReplayer(settings)
    try:
        answer = replayer.replay(envelope)
    finally:
        replayer.close()
    if isinstance(answer, str):
        say(f"reprolane: schedule lane not used: {answer}; replaying one request at a time on lane {settings.lane}")
        return None
    return answer


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
        as_json: JsonOpt = False,
        client_request_id: ClientIdOpt = None,
        tenant: TenantOpt = None,
        via: ViaOpt = "auto",
        timeout_s: ServiceTimeoutOpt = DEFAULT_SERVICE_TIMEOUT_S,
    ) -> None:
        """Replay one recorded request and print what diverged (exit 0: target held, 1: not, 2: no verdict).

        With a replayer service running (its lane loaded) the service replays it, in seconds; without one
        (``--via auto``, the default) a lane is loaded here, which takes a while, and stderr says so."""
        if via not in VIAS:
            raise typer.BadParameter(f"--via must be one of {', '.join(VIAS)}, not {via!r}")
        if (request_id is None) == (client_request_id is None) or (client_request_id is None) != (tenant is None):
            raise typer.BadParameter("give REQUEST_ID, or --client-request-id with --tenant")
        store = store_factory(settings)
        if client_request_id is not None and tenant is not None:
            envelope = store.find_by_client_request_id(tenant, client_request_id)[-1]
            request_id = envelope.request_id
        else:
            assert request_id is not None
            envelope = store.get_by_request_id(request_id)
        if not envelope.replayable:
            raise NotReplayableError(f"request {request_id} is not replayable: {not_replayable_reason(envelope)}")
        with machine_output(True) as document:  # the report, text or JSON, alone on stdout: a lane's logs on stderr
            result = (
                None
                if via == "local"
                else replay_via_service(
                    envelope, store, settings, via, timeout_s, lambda line: typer.echo(line, err=True)
                )
            )
            if result is None:
                result = _replay_scheduled(envelope, settings, lambda line: typer.echo(line, err=True))
            if result is None:
                lane = lane_factory(settings)
                try:
                    result = _replay(envelope, lane, settings)
                finally:
                    lane.close()
            document(result.model_dump_json(indent=2) if as_json else render_request(envelope, result).rstrip("\n"))
        raise typer.Exit(0 if result.event.target_met else 1)

    @app.command("workflow")
    @settings_options(*REPLAY_OPTIONS)
    def workflow(
        workflow_id: WorkflowIdArg, settings: ReplayerSettings, as_json: JsonOpt = False, tenant: TenantOpt = None
    ) -> None:
        """Replay every recorded step of a workflow in order; report the first step that diverges."""
        envelopes = store_factory(settings).list_workflow(workflow_id, tenant)
        steps: list[WorkflowStep] = []
        with machine_output(True) as document:  # as in `request`
            lane = lane_factory(settings)
            try:
                for envelope in envelopes:
                    if not envelope.replayable:
                        steps.append(WorkflowStep(envelope, None, not_replayable_reason(envelope)))
                        continue
                    steps.append(WorkflowStep(envelope, _replay(envelope, lane, settings)))
            finally:
                lane.close()
            first = first_diverging(steps)
            if as_json:
                document(json.dumps(_workflow_json(workflow_id, steps, first), indent=2, ensure_ascii=False))
            else:
                document(render_workflow(workflow_id, steps).rstrip("\n"))
        raise typer.Exit(1 if first is not None else 0)

    return app


def build_show_command(*, store_factory: StoreFactory = EnvelopeStore.from_settings) -> Callable[..., None]:
    """``reprolane show``: the envelope exactly as recorded (`replayer.show`)."""

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
        """Show the envelope recorded for a request, checked against its content address (exit 2: not found)."""
        if (request_id is None) == (client_request_id is None) or (client_request_id is None) != (tenant is None):
            raise typer.BadParameter("give REQUEST_ID, or --client-request-id with --tenant")
        store = store_factory(settings)
        if client_request_id is not None and tenant is not None:
            record = store.read_client_records(tenant, client_request_id)[-1]
        else:
            assert request_id is not None
            record = store.read_record(request_id)
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
        """Consume envelopes, replay the flagged ones, publish divergence events (until SIGINT/SIGTERM)."""
        run = serve_fn
        if run is None:
            from replayer.service import serve

            run = serve
        run(settings)

    return app


replay_app = build_replay_app()
replayer_app = build_replayer_app()
show_command = build_show_command()
