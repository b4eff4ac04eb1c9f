"""The ``matrix`` and ``explain`` commands (registered on the root app by `infra.cli`).

    reprolane replay matrix [--envelopes FILE.jsonl | --request-ids A,B | --from-s3 TENANT/DATE | --workload]
                     [--cells batch,order,dtype,...] [--max-tokens 32] [--baseline recorded|single]
                     [--json] [--report FILE.json] [--html FILE.html] [--include-slow] [--semantic]
    reprolane replay explain REQUEST_ID [--envelopes FILE.jsonl] [--window-s 5] [--variations alone,batch,...] [--json]

``matrix`` exit codes: 0 every runnable cell ran, 1 some cell failed, 2 bad arguments or no input.
``explain`` exit codes: 0 some variation reproduced the recorded output, 1 none did, 2 unknown request id, bad
arguments, or an envelope that cannot be replayed. The commands raise (``typer.BadParameter`` for bad input,
`replayer.errors` for the rest); the root of the command line (`infra.cli`) prints one line on stderr and exits 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from replayer.cli_options import S3_OPTIONS, make_lane, settings_options
from replayer.errors import EnvelopeNotFoundError, NotReplayableError, StoreError
from replayer.machine_output import machine_output
from replayer.matrix.dimensions import parse_dimensions, plan_cells
from replayer.matrix.explain import DEFAULT_WINDOW_S, VARIATIONS, explain, render_explanation
from replayer.matrix.inputs import (
    MatrixItem,
    Workload,
    default_workload,
    items_from_envelopes,
    load_prompt_file,
    read_envelopes_jsonl,
    spread,
    workload_items,
)
from replayer.matrix.report import render_html, render_json, render_table
from replayer.matrix.results import BaselineMode
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayResult
from schemas.layout import ENVELOPES_PREFIX, capture_day, envelope_day_infix, envelope_day_prefix

#: The shared workload (bundled by infra); the package's DEFAULT_PROMPTS are used when it is absent.
WORKLOAD_FILE = Path(__file__).resolve().parents[2] / "infra" / "workload" / "prompts.json"

EnvelopesOpt = Annotated[Path | None, typer.Option("--envelopes", help="JSONL file, one envelope per line")]
WorkloadFileOpt = Annotated[Path | None, typer.Option("--workload-file", help="JSON prompt list (default: bundled)")]


#: The settings options of ``matrix`` and ``explain``.
MATRIX_OPTIONS = ("model_dir", *S3_OPTIONS)


def _model_dir(settings: ReplayerSettings) -> Path:
    from replayer.lanes.base import resolve_model_dir

    return resolve_model_dir(settings)


def _prompts(path: Path | None) -> Workload:
    source = path or (WORKLOAD_FILE if WORKLOAD_FILE.is_file() else None)
    if source is None:
        return default_workload()
    try:
        return load_prompt_file(source)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc


def _workload(model_dir: Path, workload: Workload, max_tokens: int, prefix: str = "workload") -> list[MatrixItem]:
    from replayer.lanes.batch_engine import render_chat

    ids = render_chat(model_dir, workload.prompts, workload.system)
    return workload_items(ids, max_tokens=max_tokens, prefix=prefix, ids=workload.ids)


def s3_prefix(spec: str) -> str:
    """``TENANT/DATE``, ``tenant=T/date=D`` or a raw ``envelopes/...`` prefix -> the key prefix to list."""
    if spec.startswith(ENVELOPES_PREFIX):
        return spec if spec.endswith("/") else spec + "/"
    parts = [p.split("=", 1)[-1] for p in spec.strip("/").split("/")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--from-s3 wants TENANT/YYYY-MM-DD, not {spec!r}")
    tenant, day = parts
    return envelope_day_prefix(tenant, day)


@settings_options(*MATRIX_OPTIONS)
def matrix_command(
    *,
    envelopes: EnvelopesOpt = None,
    request_ids: Annotated[str | None, typer.Option("--request-ids", help="comma-separated recorded ids")] = None,
    from_s3: Annotated[str | None, typer.Option("--from-s3", help="every envelope of TENANT/YYYY-MM-DD")] = None,
    workload: Annotated[bool, typer.Option("--workload", help="the bundled prompt set (the default input)")] = False,
    workload_file: WorkloadFileOpt = None,
    cells: Annotated[str | None, typer.Option("--cells", help="dimensions, comma-separated (default: all)")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, max=4096, help="tokens per workload prompt")] = 32,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="at most N requests (workload: spread over the file)")
    ] = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="recorded | single")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="the JSON report on stdout (the one document there; the table on stderr)")
    ] = False,
    report_out: Annotated[Path | None, typer.Option("--report", help="write the JSON report to this file")] = None,
    html_out: Annotated[Path | None, typer.Option("--html", help="write the HTML report to this file")] = None,
    include_slow: Annotated[bool, typer.Option("--include-slow", help="also run torch.compile cells")] = False,
    semantic: Annotated[bool, typer.Option("--semantic", help="semantic similarity of final texts")] = False,
    settings: ReplayerSettings,
) -> None:
    """Replay a set of requests across batch, order, input-length, dtype, threads, prefix-cache, ... cells.

    Example: reprolane replay matrix --workload --limit 12 --html matrix.html
    """
    sources = [s for s in (envelopes, request_ids, from_s3, workload or None) if s]
    if len(sources) > 1:
        raise typer.BadParameter("give one input: --envelopes, --request-ids, --from-s3 or --workload")
    if baseline not in (None, "recorded", "single"):
        raise typer.BadParameter(f"--baseline must be recorded or single, not {baseline!r}")
    try:
        dims = parse_dimensions(cells)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    with machine_output(as_json) as document:
        mdir = _model_dir(settings)
        rejected: list[tuple[str, str]] = []
        if envelopes is not None:
            items, rejected = items_from_envelopes(read_envelopes_jsonl(envelopes))
            source = str(envelopes)
        elif request_ids or from_s3:
            store = EnvelopeStore.from_settings(settings)
            if request_ids:
                envs = [store.get_by_request_id(r.strip()) for r in request_ids.split(",") if r.strip()]
                source = f"request ids {request_ids}"
            else:
                try:
                    prefix = s3_prefix(from_s3 or "")
                except ValueError as exc:
                    raise typer.BadParameter(str(exc)) from exc
                envs, undecodable = store.scan_envelopes(prefix)
                source = f"s3://{store.bucket}/{prefix}"
            items, rejected = items_from_envelopes(envs)
            if from_s3:
                rejected += [(key, f"does not decode as an envelope: {why}") for key, why in undecodable]
        else:
            wl = spread(_prompts(workload_file), limit)
            items, source = _workload(mdir, wl, max_tokens), f"the workload ({len(wl.prompts)} prompts)"
        items = items[:limit] if limit else items
        if not items:
            raise typer.BadParameter("no replayable request in the input")
        has_recorded = all(i.recorded is not None for i in items)
        mode: BaselineMode = "recorded" if has_recorded else "single"
        if baseline == "single":
            mode = "single"
        elif baseline == "recorded" and not has_recorded:
            raise typer.BadParameter(
                "--baseline recorded needs recorded envelopes (the workload has no recorded outputs)"
            )
        from replayer.lanes.batch_engine import probe_platform
        from replayer.matrix.pipeline import run_matrix

        similarity = None
        if semantic:
            from replayer.semantic import similarity as text_similarity

            similarity = text_similarity
        platform = probe_platform()
        report = run_matrix(
            items, plan_cells(platform, dims, include_slow=include_slow), model_dir=mdir, platform=platform,
            baseline=mode, source=source, rejected=rejected, thresholds=settings.thresholds, similarity=similarity,
            progress=True,
        )  # fmt: skip
        typer.echo(render_table(report))
        if as_json:
            document(render_json(report))
        if report_out is not None:
            report_out.write_text(render_json(report), encoding="utf-8")
            typer.echo(f"JSON: {report_out}")
        if html_out is not None:
            html_out.write_text(render_html(report), encoding="utf-8")
            typer.echo(f"HTML: {html_out}")
    raise typer.Exit(1 if any(c.status == "failed" for c in report.cells) else 0)


def _find(envelopes: list[Envelope], request_id: str) -> Envelope:
    for env in envelopes:
        if env.request_id == request_id:
            return env
    raise EnvelopeNotFoundError(f"no envelope with request id {request_id!r} in the file")


def _on_schedule(target: Envelope, settings: ReplayerSettings, store: EnvelopeStore | None) -> ReplayResult | str:
    """The ``schedule`` variation: the target on the schedule lane as every replay entry point has it
    (`replayer.lane_choice`), the result stored there already being the answer and a fresh one stored, so
    ``explain`` and ``replay request`` say the same verdict; or why it could not run."""
    from replayer.lane_choice import SCHEDULE_LANE, LaneChoice, keep
    from replayer.schedule.replay import ScheduleReplayer

    choice = LaneChoice(settings, lambda: make_lane(settings), ScheduleReplayer(settings))
    try:
        replayed = choice.replay(target, lane=SCHEDULE_LANE, stored=None if store is None else store.get_result)
    except NotReplayableError as exc:
        return str(exc)
    finally:
        choice.close()
    if store is None:
        return replayed.result
    try:
        return keep(store, target, replayed)[0]
    except StoreError:  # the explanation stands without it; the console will not show this replay
        return replayed.result


@settings_options(*MATRIX_OPTIONS)
def explain_command(
    request_id: Annotated[str, typer.Argument(help="the recorded request id to explain")],
    *,
    envelopes: EnvelopesOpt = None,
    window_s: Annotated[
        float, typer.Option("--window-s", min=0.0, help="companion capture window (s)")
    ] = DEFAULT_WINDOW_S,
    as_json: Annotated[bool, typer.Option("--json", help="print the explanation as JSON")] = False,
    variations: Annotated[str | None, typer.Option("--variations", help="comma-separated subset")] = None,
    workload_file: WorkloadFileOpt = None,
    settings: ReplayerSettings,
) -> None:
    """Re-replay one diverged request under targeted variations and name the one that reproduces the capture.

    Example: reprolane replay explain rl-5e0c2a9d41b7f3e88c06d2a4f1b9e375 --envelopes run.jsonl --variations alone,batch
    """
    extra_notes: list[str] = []
    store: EnvelopeStore | None = None
    if envelopes is not None:
        candidates = read_envelopes_jsonl(envelopes)
        target = _find(candidates, request_id)
    else:
        store = EnvelopeStore.from_settings(settings)
        target = store.get_by_request_id(request_id)
        day = envelope_day_infix(capture_day(target.captured_at))
        candidates, undecodable = store.scan_envelopes(ENVELOPES_PREFIX, contains=day)
        if undecodable:
            extra_notes.append(
                f"{len(undecodable)} stored object(s) of that day do not decode as envelopes (encrypted?) and "
                "could not be companions"
            )
    if not target.replayable:
        from replayer.selection import not_replayable_reason

        raise NotReplayableError(f"request {request_id} is not replayable: {not_replayable_reason(target)}")
    only = [v.strip() for v in variations.split(",") if v.strip()] if variations else None
    unknown = sorted(set(only or ()) - set(VARIATIONS))
    if unknown:
        raise typer.BadParameter(f"unknown variation(s) {', '.join(unknown)}; known: {', '.join(VARIATIONS)}")
    mdir = _model_dir(settings)
    from replayer.lanes.batch_engine import probe_platform

    max_tokens = (target.sampling.max_tokens if target.sampling else None) or 32
    prompts = _prompts(workload_file)

    def padding(n: int) -> list[MatrixItem]:
        picks = [i % len(prompts.prompts) for i in range(n)]
        chosen = Workload(tuple(prompts.prompts[i] for i in picks), tuple(f"{k:03d}" for k in range(n)), prompts.system)
        return _workload(mdir, chosen, max_tokens, prefix="padding")

    with machine_output(as_json) as document:
        schedule: ReplayResult | str | None = None
        if target.schedule is not None and (only is None or "schedule" in only):
            schedule = _on_schedule(target, settings, store)
        try:
            result = explain(
                target, candidates, model_dir=mdir, platform=probe_platform(), padding_factory=padding,
                window_s=window_s, thresholds=settings.thresholds, only=only, progress=not as_json, notes=extra_notes,
                schedule=schedule,
            )  # fmt: skip
        except ValueError as exc:  # the target or a companion cannot be replayed (explain says why)
            raise NotReplayableError(str(exc)) from exc
        document(result.model_dump_json(indent=2) if as_json else render_explanation(result))
    raise typer.Exit(result.exit_code)
