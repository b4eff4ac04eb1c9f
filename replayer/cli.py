"""The replayer's command line: two typer sub-apps that `infra.cli` registers as ``replay`` and ``replayer``.

    reprolane replay request REQUEST_ID [--lane vllm|remote|transformers] [--json] [--s3-endpoint URL ...]
    reprolane replay workflow WORKFLOW_ID [same options]
    reprolane replayer serve [--lane ...] [--kafka-bootstrap HOST:PORT] [--group-id G] [--replay-all] [...]

Settings come from ``REPROLANE_REPLAYER_*`` and are overridden by the options given. Exit codes of ``replay``:
0 when the target level held (every replayed step, for a workflow), 1 when it did not, 2 when no verdict could be
reached: unknown id, bad arguments or settings, an envelope that cannot be replayed, S3 or the lane unavailable.
Errors are one line on stderr (``error: ...``), never a traceback.

The apps are built by factories (`build_replay_app`, `build_replayer_app`) so tests can inject a lane factory
(a fake or perturbing lane) and a store factory without loading a model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError

from replayer.errors import ReplayerError
from replayer.lanes.base import Lane
from replayer.report import WorkflowStep, first_diverging, render_request, render_workflow
from replayer.selection import not_replayable_reason
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import ContractError, Envelope, ReplayResult

LaneFactory = Callable[[ReplayerSettings], Lane]
StoreFactory = Callable[[ReplayerSettings], EnvelopeStore]
LANES = ("vllm", "remote", "transformers")


def _make_lane(settings: ReplayerSettings) -> Lane:
    from replayer.lanes import make_lane

    return make_lane(settings)


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


LaneOpt = Annotated[str | None, typer.Option("--lane", help="vllm | remote | transformers (default: settings)")]
S3EndpointOpt = Annotated[str | None, typer.Option("--s3-endpoint", help="S3 endpoint URL")]
S3AccessOpt = Annotated[str | None, typer.Option("--s3-access-key", help="S3 access key id")]
S3SecretOpt = Annotated[str | None, typer.Option("--s3-secret-key", help="S3 secret key")]
S3BucketOpt = Annotated[str | None, typer.Option("--s3-bucket", help="audit bucket")]
ModelDirOpt = Annotated[Path | None, typer.Option("--model-dir", help="HF model folder for local lanes")]
RemoteOpt = Annotated[str | None, typer.Option("--remote-url", help="base URL of the remote lane")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the replay result(s) as JSON")]


def build_settings(**options: Any) -> ReplayerSettings:
    """Settings from the environment, overridden by the options that were given (None = not given)."""
    lane = options.get("lane")
    if lane is not None and lane not in LANES:
        _fail(f"--lane must be one of {', '.join(LANES)}, not {lane!r}")
    given = {k: v for k, v in options.items() if v is not None}
    try:
        return ReplayerSettings(**given)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        _fail(f"invalid setting {field}: {err['msg']}")


def _replay(envelope: Envelope, lane: Lane, settings: ReplayerSettings) -> ReplayResult:
    from replayer.replay import replay_envelope

    return replay_envelope(envelope, lane, settings)


def build_replay_app(
    *, lane_factory: LaneFactory = _make_lane, store_factory: StoreFactory = EnvelopeStore.from_settings
) -> typer.Typer:
    """The ``replay`` sub-app (see module docstring)."""
    app = typer.Typer(
        help="Replay recorded requests on a deterministic lane and report divergence.", add_completion=False
    )

    def _open(settings: ReplayerSettings) -> tuple[EnvelopeStore, Callable[[], Lane]]:
        try:
            store = store_factory(settings)
        except ReplayerError as exc:
            _fail(str(exc))
        return store, lambda: lane_factory(settings)

    @app.command("request")
    def request(
        request_id: Annotated[str, typer.Argument(help="the request id the sidecar recorded")],
        lane: LaneOpt = None,
        as_json: JsonOpt = False,
        s3_endpoint: S3EndpointOpt = None,
        s3_access_key: S3AccessOpt = None,
        s3_secret_key: S3SecretOpt = None,
        s3_bucket: S3BucketOpt = None,
        model_dir: ModelDirOpt = None,
        remote_url: RemoteOpt = None,
    ) -> None:
        """Replay one recorded request and print what diverged (exit 0: target held, 1: not, 2: no verdict)."""
        settings = build_settings(
            lane=lane, s3_endpoint=s3_endpoint, s3_access_key=s3_access_key, s3_secret_key=s3_secret_key,
            s3_bucket=s3_bucket, model_dir=model_dir, remote_url=remote_url,
        )  # fmt: skip
        store, open_lane = _open(settings)
        try:
            envelope = store.get_by_request_id(request_id)
            if not envelope.replayable:
                _fail(f"request {request_id} is not replayable: {not_replayable_reason(envelope)}")
            the_lane = open_lane()
            try:
                result = _replay(envelope, the_lane, settings)
            finally:
                the_lane.close()
        except (ReplayerError, ContractError) as exc:
            _fail(str(exc))
        typer.echo(result.model_dump_json(indent=2) if as_json else render_request(envelope, result), nl=not as_json)
        if as_json:
            typer.echo("")
        raise typer.Exit(0 if result.event.target_met else 1)

    @app.command("workflow")
    def workflow(
        workflow_id: Annotated[str, typer.Argument(help="the agent workflow id the sidecar recorded")],
        lane: LaneOpt = None,
        as_json: JsonOpt = False,
        s3_endpoint: S3EndpointOpt = None,
        s3_access_key: S3AccessOpt = None,
        s3_secret_key: S3SecretOpt = None,
        s3_bucket: S3BucketOpt = None,
        model_dir: ModelDirOpt = None,
        remote_url: RemoteOpt = None,
    ) -> None:
        """Replay every recorded step of a workflow in order; report the first step that diverges."""
        settings = build_settings(
            lane=lane, s3_endpoint=s3_endpoint, s3_access_key=s3_access_key, s3_secret_key=s3_secret_key,
            s3_bucket=s3_bucket, model_dir=model_dir, remote_url=remote_url,
        )  # fmt: skip
        store, open_lane = _open(settings)
        steps: list[WorkflowStep] = []
        try:
            envelopes = store.list_workflow(workflow_id)
            the_lane = open_lane()
            try:
                for envelope in envelopes:
                    if not envelope.replayable:
                        steps.append(WorkflowStep(envelope, None, not_replayable_reason(envelope)))
                        continue
                    steps.append(WorkflowStep(envelope, _replay(envelope, the_lane, settings)))
            finally:
                the_lane.close()
        except (ReplayerError, ContractError) as exc:
            _fail(str(exc))
        first = first_diverging(steps)
        if as_json:
            typer.echo(json.dumps(_workflow_json(workflow_id, steps, first), indent=2, ensure_ascii=False))
        else:
            typer.echo(render_workflow(workflow_id, steps), nl=False)
        raise typer.Exit(1 if first is not None else 0)

    return app


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
    def serve_cmd(
        lane: LaneOpt = None,
        kafka_bootstrap: Annotated[str | None, typer.Option("--kafka-bootstrap", help="HOST:PORT")] = None,
        group_id: Annotated[str | None, typer.Option("--group-id", help="consumer group")] = None,
        replay_all: Annotated[
            bool | None, typer.Option("--replay-all/--flagged-only", help="replay every envelope")
        ] = None,
        metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Prometheus port (127.0.0.1)")] = None,
        s3_endpoint: S3EndpointOpt = None,
        s3_access_key: S3AccessOpt = None,
        s3_secret_key: S3SecretOpt = None,
        s3_bucket: S3BucketOpt = None,
        model_dir: ModelDirOpt = None,
        remote_url: RemoteOpt = None,
    ) -> None:
        """Consume envelopes, replay the flagged ones, publish divergence events (until SIGINT/SIGTERM)."""
        settings = build_settings(
            lane=lane, kafka_bootstrap=kafka_bootstrap, group_id=group_id, replay_all=replay_all,
            metrics_port=metrics_port, s3_endpoint=s3_endpoint, s3_access_key=s3_access_key,
            s3_secret_key=s3_secret_key, s3_bucket=s3_bucket, model_dir=model_dir, remote_url=remote_url,
        )  # fmt: skip
        run = serve_fn
        if run is None:
            from replayer.service import serve

            run = serve
        try:
            run(settings)
        except ReplayerError as exc:
            _fail(str(exc))

    return app


replay_app = build_replay_app()
replayer_app = build_replayer_app()
