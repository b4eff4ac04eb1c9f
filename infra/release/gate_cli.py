"""``reprolane release gate``: the release gate (replay mode and statistical vendor mode) and ``gate record-golden``.

    reprolane release gate --baseline A.json|golden --candidate B.json|local --golden SET
                   [--lane vllm|remote|transformers] [--remote-url URL] [--model-dir DIR] [--dtype D]
                   [--level LEVEL] [--min-pass-rate R] [--always-replay] [--limit N] [--report FILE.json]
                   [--deployment NAME] [--image REF] [--engine-args "ARGS"] [--no-known-good]
    reprolane release gate --statistical --golden CASES --upstream URL [--samples N] [--assertions FILE.json]
                   [--min-similarity S] [--min-assertion-rate R] [--min-pass-rate P] [--report FILE.json]
    reprolane release gate --shadow --since T [--until T] [--level LEVEL] [--min-pass-rate R] [--min-similarity S]
                   [--max-length-change L] [--max-finish-shift F] [--report FILE.json]
    reprolane release gate record-golden --output FILE (--from-s3 SELECTOR | --workload-file FILE [--lane L]
                   [--tokenize-url URL] | --vendor --workload-file FILE --upstream URL)

SET is a JSONL file of envelopes or an S3 selector (``s3:tenant=T``, ``s3:workflow=ID``, ``s3:request-ids=a,b``);
see `replayer.gate.golden`. The gate logic is `replayer.gate.replay` / `replayer.gate.statistical`, the recording
of golden sets `infra.release.gate_record`; this module is the composition root's part: it reads files, takes the
local fingerprint (``--candidate local`` = the artifacts of the lane's model folder, verified against its manifest,
plus the runtime fingerprint the started lane reports; the lane defaults to ``REPROLANE_REPLAYER_LANE``) and gives
the verdict as the exit code: **0** the gate passed, **1** it failed. Without a verdict it raises:
``typer.BadParameter`` for bad input, a `replayer.errors.ReplayerError` (``GateInputError`` for an unreadable golden
set or a model folder that does not verify, ``LaneUnavailableError``, ``StoreError``) or a ``ContractError``, which
the root of the command line (`infra.cli`) prints as one line on stderr with exit **2**. ``--report`` gets the JSON
report; stdout gets the readable summary.

``--shadow`` judges the production/candidate pairs shadow traffic recorded in a time window (`replayer.gate.shadow`;
T is an ISO time or an age: ``30m``, ``2h``, ``1d``).

Known-good environments (`infra.release.known_good`): a passing replay gate writes the candidate's environment (its
fingerprint, ``--image``, ``--engine-args`` and the lane model folder's manifest when it is the candidate's) once
into the audit bucket under ``--deployment``'s history; a failing one names that deployment's last known-good
environment other than the candidate, in the report (``rollback``) and on stdout, with what to deploy.
``--no-known-good`` does neither (a dry run); without any S3 settings (no endpoint, no access key) neither
happens either, and stderr says so. A history that cannot be read or written is a `KnownGoodError`,
translated to `StoreError` here: the gate then has no verdict (exit 2), like any other S3 failure of the gate.

It and `infra.release.gate_record` live in ``infra``, not ``replayer``, because ``--candidate local`` and
``record-golden`` fingerprint the lane's model folder against the model cache's manifest (`infra.release.fingerprint`,
`infra.model.manifest`): the dependency direction stays infra -> replayer -> schemas.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from infra.cli_options import deployment_name, read_fingerprint
from infra.release.gate_record import lane_artifacts, read_workload, record_lane, record_vendor
from infra.release.known_good import (
    KnownGoodError,
    KnownGoodHistory,
    KnownGoodStore,
    build_known_good,
    candidate_manifest,
    last_known_good,
    rollback_lines,
)
from replayer.cli_options import LaneFactory, StoreFactory, build_settings, make_lane
from replayer.errors import LaneUnavailableError, StoreError
from replayer.gate.golden import (
    GoldenSet,
    golden_environment,
    load_golden_file,
    load_golden_s3,
    parse_s3_selector,
    write_golden,
)
from replayer.gate.replay import GateReport, render_gate, run_gate
from replayer.gate.shadow import ShadowBars, load_pairs, render_shadow, shadow_gate
from replayer.gate.statistical import (
    Assertion,
    Sampler,
    case_from_envelope,
    load_assertions,
    load_cases,
    render_statistical,
    run_statistical_gate,
)
from replayer.gate.vendor_client import HttpSampler
from replayer.lanes.base import Lane, resolve_model_dir
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import (
    ContractError,
    EnvironmentFingerprint,
    ReproLevel,
)
from schemas.known_good import DEFAULT_DEPLOYMENT, ImageRef, parse_image_ref
from schemas.levels import LEVEL_ORDER

SamplerFactory = Callable[[str, str | None], Sampler]
SimilarityFn = Callable[[str, str], float]
HistoryFactory = Callable[[ReplayerSettings], KnownGoodHistory | None]


def audit_history(settings: ReplayerSettings) -> KnownGoodStore | None:
    """The known-good history of the audit bucket; None when no S3 is configured at all (no endpoint, no access
    key: the gate then says so on stderr and records nothing)."""
    if settings.s3_endpoint is None and settings.s3_access_key is None:
        return None
    return KnownGoodStore.from_settings(settings)


def _similarity(a: str, b: str) -> float:
    from replayer.semantic import similarity

    return similarity(a, b)


def _http_sampler(url: str, model: str | None) -> Sampler:
    return HttpSampler(url, model=model)


def _level(value: str | None) -> ReproLevel | None:
    if value is not None and value not in LEVEL_ORDER:
        raise typer.BadParameter(f"--level must be one of {', '.join(LEVEL_ORDER)}, not {value!r}")
    return value


def _load_golden(spec: str, settings: ReplayerSettings, store_factory: StoreFactory, limit: int | None) -> GoldenSet:
    if spec.startswith("s3:"):
        selector = parse_s3_selector(spec)
        return load_golden_s3(store_factory(settings), selector, limit=limit)
    return load_golden_file(Path(spec))


def _local_fingerprint(settings: ReplayerSettings, lane: Lane) -> EnvironmentFingerprint:
    name, artifacts = lane_artifacts(settings)
    return EnvironmentFingerprint(
        model_name=name,
        artifacts=artifacts,
        runtime=lane.fingerprint(),
        taken_at=datetime.now(UTC),
        source=f"local lane {lane.name}",
    )


def _write_report(path: Path | None, data: str) -> None:
    if path is None:
        return
    try:
        path.write_text(data + "\n", encoding="utf-8")
    except OSError as exc:
        raise typer.BadParameter(f"cannot write report {path}: {exc.strerror}") from exc


def _image(value: str | None) -> ImageRef | None:
    try:
        return None if value is None else parse_image_ref(value)
    except ContractError as exc:
        raise typer.BadParameter(f"--image: {exc}") from exc


def _engine_args(value: str | None) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(value)) if value else ()
    except ValueError as exc:
        raise typer.BadParameter(f"--engine-args: {exc}") from exc


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_when(value: str, option: str, now: datetime) -> datetime:
    """``--since`` / ``--until``: an ISO time (UTC if it names no zone) or an age before `now` (``30m``, ``2h``)."""
    text = value.strip()
    if text[:-1].isdigit() and text[-1:] in _AGE_UNITS:
        return now - timedelta(seconds=int(text[:-1]) * _AGE_UNITS[text[-1]])
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"{option} must be an ISO time or an age like 30m, 2h, 1d: {value!r}") from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).astimezone(UTC)


def _gate_model_dir(settings: ReplayerSettings) -> Path | None:
    """The lane's model folder, whose manifest a pass records when it is the candidate's; None when there is none."""
    if settings.lane == "remote" and settings.model_dir is None:
        return None
    try:
        return resolve_model_dir(settings)
    except LaneUnavailableError:
        return None


def _with_known_good(
    result: GateReport, history: KnownGoodHistory, settings: ReplayerSettings, deployment: str,
    image: ImageRef | None, engine_args: tuple[str, ...],
) -> GateReport:  # fmt: skip
    """A pass records the candidate's environment; a fail names the last known-good one (module docstring)."""
    try:
        if result.gate_passed:
            record = build_known_good(
                result, deployment=deployment, image=image, engine_args=engine_args,
                manifest=candidate_manifest(_gate_model_dir(settings), result),
            )  # fmt: skip
            key = history.put(record)
            return result.model_copy(update={"deployment": deployment, "known_good_key": key})
        target = last_known_good(history, deployment, other_than=result.candidate_sha256)
        return result.model_copy(update={"deployment": deployment, "rollback": target})
    except KnownGoodError as exc:
        raise StoreError(f"known-good history: {exc}") from exc


Opt = typer.Option


def build_gate_app(
    *,
    lane_factory: LaneFactory = make_lane,
    store_factory: StoreFactory = EnvelopeStore.from_settings,
    sampler_factory: SamplerFactory = _http_sampler,
    similarity: SimilarityFn = _similarity,
    history_factory: HistoryFactory = audit_history,
) -> typer.Typer:
    """The ``gate`` sub-app; tests inject a fake lane, store, sampler, similarity and known-good history."""
    app = typer.Typer(
        help="Release gate: replay the golden set when the environment fingerprint changes.\n\n"
        "Example: reprolane release gate --baseline golden --candidate local --golden golden.jsonl --report gate.json",
        invoke_without_command=True,
        add_completion=False,
    )

    @app.callback()
    def gate(
        ctx: typer.Context,
        golden: Annotated[
            str | None, Opt("--golden", help="JSONL of envelopes, or s3:tenant=T|workflow=ID|request-ids=a,b")
        ] = None,
        baseline: Annotated[str | None, Opt("--baseline", help="fingerprint JSON, or 'golden'")] = None,
        candidate: Annotated[
            str | None, Opt("--candidate", help="fingerprint JSON of the candidate, or 'local'")
        ] = None,
        lane: Annotated[str | None, Opt("--lane", help="vllm | remote | transformers: executes the candidate")] = None,
        remote_url: Annotated[str | None, Opt("--remote-url", help="base URL of the remote lane")] = None,
        model_dir: Annotated[Path | None, Opt("--model-dir", help="HF model folder of the local lanes")] = None,
        dtype: Annotated[str | None, Opt("--dtype", help="dtype of the vllm lane")] = None,
        level: Annotated[str | None, Opt("--level", help="judge every envelope at this level")] = None,
        min_pass_rate: Annotated[float, Opt("--min-pass-rate", min=0.0, max=1.0)] = 1.0,
        always_replay: Annotated[bool, Opt("--always-replay", help="replay even when nothing changed")] = False,
        limit: Annotated[int | None, Opt("--limit", min=1, help="at most N envelopes from an S3 selector")] = None,
        report: Annotated[Path | None, Opt("--report", help="write the JSON report here")] = None,
        statistical: Annotated[bool, Opt("--statistical", help="vendor mode: sample, similarity, assertions")] = False,
        upstream: Annotated[str | None, Opt("--upstream", help="statistical mode: candidate base URL")] = None,
        model: Annotated[str | None, Opt("--model", help="statistical mode: override the recorded model alias")] = None,
        samples: Annotated[int, Opt("--samples", min=1, max=100)] = 5,
        assertions: Annotated[Path | None, Opt("--assertions", help="JSON: request_id -> assertions")] = None,
        min_similarity: Annotated[float, Opt("--min-similarity", min=-1.0, max=1.0)] = 0.8,
        min_assertion_rate: Annotated[float, Opt("--min-assertion-rate", min=0.0, max=1.0)] = 1.0,
        deployment: Annotated[
            str, Opt("--deployment", help="whose known-good history (a pass is recorded)", callback=deployment_name)
        ] = DEFAULT_DEPLOYMENT,
        image: Annotated[str | None, Opt("--image", help="the candidate's image: repo[:tag][@sha256:...]")] = None,
        engine_args: Annotated[str | None, Opt("--engine-args", help="the candidate engine's arguments")] = None,
        no_known_good: Annotated[
            bool, Opt("--no-known-good", help="neither record a pass nor name a rollback target")
        ] = False,
        shadow: Annotated[bool, Opt("--shadow", help="judge the shadow pairs of a time window")] = False,
        since: Annotated[str | None, Opt("--since", help="shadow mode: window start (ISO time, or 30m, 2h)")] = None,
        until: Annotated[str | None, Opt("--until", help="shadow mode: window end (default now)")] = None,
        max_length_change: Annotated[float, Opt("--max-length-change", min=0.0)] = 0.25,
        max_finish_shift: Annotated[float, Opt("--max-finish-shift", min=0.0, max=1.0)] = 0.1,
    ) -> None:
        """Gate a candidate environment (exit 0 pass, 1 fail, 2 no verdict)."""
        if ctx.invoked_subcommand is not None:
            return
        if shadow:
            bars = ShadowBars(min_pass_rate=min_pass_rate, min_similarity=min_similarity,
                              max_length_change=max_length_change, max_finish_shift=max_finish_shift)  # fmt: skip
            _shadow(since, until, level, bars, report)
        if golden is None:
            raise typer.BadParameter("--golden is required")
        settings = build_settings(lane=lane, remote_url=remote_url, model_dir=model_dir, dtype=dtype)
        if statistical:
            _statistical(golden, settings, upstream, model, samples, assertions, min_similarity,
                         min_assertion_rate, min_pass_rate, limit, report)  # fmt: skip
        if baseline is None or candidate is None:
            raise typer.BadParameter("--baseline and --candidate are required (or --statistical)")
        judged = _level(level)
        image_ref, engine_argv = _image(image), _engine_args(engine_args)
        golden_set = _load_golden(golden, settings, store_factory, limit)
        base = golden_environment(golden_set) if baseline == "golden" else read_fingerprint(Path(baseline), "baseline")
        opened: list[Lane] = []  # the lane 'local' fingerprinted, handed to the replay if one is needed

        def open_lane() -> Lane:
            if opened:
                return opened.pop()
            return lane_factory(settings)

        try:
            if candidate == "local":
                opened.append(lane_factory(settings))
                cand = _local_fingerprint(settings, opened[0])
            else:
                cand = read_fingerprint(Path(candidate), "candidate")
            result = run_gate(golden_set, base, cand, open_lane, settings, level=judged,
                              min_pass_rate=min_pass_rate, always_replay=always_replay)  # fmt: skip
        finally:
            for leftover in opened:  # opened for 'local' but no replay was needed, or the gate raised
                leftover.close()
        history = None if no_known_good else history_factory(settings)
        if history is not None:
            result = _with_known_good(result, history, settings, deployment, image_ref, engine_argv)
        elif not no_known_good:
            typer.echo("known-good history: no audit bucket configured (REPROLANE_REPLAYER_S3_*): nothing recorded"
                       " or looked up", err=True)  # fmt: skip
        _write_report(report, result.model_dump_json(indent=2))
        typer.echo(render_gate(result), nl=False)
        if result.known_good_key is not None:
            typer.echo(f"Recorded known-good environment {result.candidate_sha256[:16]} ({deployment}): "
                       f"{result.known_good_key}")  # fmt: skip
        elif not result.gate_passed and history is not None:
            typer.echo("\n".join(rollback_lines(result.rollback, deployment)))
        raise typer.Exit(0 if result.gate_passed else 1)

    def _shadow(
        since: str | None, until: str | None, level: str | None, bars: ShadowBars, report: Path | None
    ) -> NoReturn:
        if since is None:
            raise typer.BadParameter("--shadow needs --since T (an ISO time, or an age like 30m)")
        now = datetime.now(UTC)
        start, end = parse_when(since, "--since", now), parse_when(until, "--until", now) if until else now
        settings = build_settings()
        pairs, unpaired = load_pairs(store_factory(settings), start, end)
        result = shadow_gate(
            pairs, unpaired, since=start, until=end, similarity=similarity, thresholds=settings.thresholds,
            level=_level(level), bars=bars,
        )  # fmt: skip
        _write_report(report, result.model_dump_json(indent=2))
        typer.echo(render_shadow(result), nl=False)
        raise typer.Exit(0 if result.gate_passed else 1)

    def _statistical(
        golden: str, settings: ReplayerSettings, upstream: str | None, model: str | None, samples: int,
        assertions: Path | None, min_similarity: float, min_assertion_rate: float, min_pass_rate: float,
        limit: int | None, report: Path | None,
    ) -> NoReturn:  # fmt: skip
        if upstream is None:
            raise typer.BadParameter("--statistical needs --upstream URL (the candidate endpoint)")
        if golden.startswith("s3:"):
            cases = tuple(case_from_envelope(e) for e in _load_golden(golden, settings, store_factory, limit).envelopes)
        else:
            cases = load_cases(Path(golden))[:limit]
        checks: dict[str, tuple[Assertion, ...]] = load_assertions(assertions) if assertions else {}
        sampler = sampler_factory(upstream, model)
        try:
            result = run_statistical_gate(
                cases, sampler, similarity, golden=golden, candidate=upstream, assertions=checks, samples=samples,
                min_similarity=min_similarity, min_assertion_rate=min_assertion_rate, min_pass_rate=min_pass_rate,
            )  # fmt: skip
        finally:
            close = getattr(sampler, "close", None)
            if callable(close):
                close()
        _write_report(report, result.model_dump_json(indent=2))
        typer.echo(render_statistical(result), nl=False)
        raise typer.Exit(0 if result.gate_passed else 1)

    @app.command("record-golden")
    def record_golden(
        out: Annotated[Path, Opt("-o", "--output", help="JSONL file to write")],
        from_s3: Annotated[
            str | None, Opt("--from-s3", help="s3:tenant=T | s3:workflow=ID | s3:request-ids=a,b")
        ] = None,
        workload: Annotated[
            Path | None, Opt("--workload-file", help="JSONL: prompt_token_ids | messages | prompt")
        ] = None,
        lane: Annotated[str | None, Opt("--lane", help="vllm | remote | transformers")] = None,
        remote_url: Annotated[str | None, Opt("--remote-url")] = None,
        model_dir: Annotated[Path | None, Opt("--model-dir")] = None,
        dtype: Annotated[str | None, Opt("--dtype")] = None,
        tokenize_url: Annotated[
            str | None, Opt("--tokenize-url", help="vLLM server whose /tokenize renders text")
        ] = None,
        max_tokens: Annotated[int, Opt("--max-tokens", min=1)] = 16,
        target_level: Annotated[str, Opt("--target-level")] = "token",
        limit: Annotated[int | None, Opt("--limit", min=1)] = None,
        vendor: Annotated[bool, Opt("--vendor", help="record statistical cases from --upstream")] = False,
        upstream: Annotated[str | None, Opt("--upstream", help="vendor mode: the upstream to record from")] = None,
    ) -> None:
        """Write a golden set: from S3 envelopes, by running a workload on a lane, or from a vendor upstream.

        Example: reprolane release gate record-golden --output golden.jsonl --from-s3 s3:tenant=acme --limit 200
        """
        if sum(x is not None for x in (from_s3, workload)) != 1:
            raise typer.BadParameter("give exactly one of --from-s3 or --workload-file")
        settings = build_settings(lane=lane, remote_url=remote_url, model_dir=model_dir, dtype=dtype)
        level = _level(target_level) or "token"
        if from_s3 is not None:
            golden_set = load_golden_s3(store_factory(settings), parse_s3_selector(from_s3), limit=limit)
            write_golden(out, golden_set.envelopes)
            typer.echo(f"wrote {len(golden_set.envelopes)} envelope(s) to {out}")
            for rid, why in golden_set.excluded:
                typer.echo(f"excluded {rid}: {why}", err=True)
            return
        assert workload is not None
        items = read_workload(workload)[:limit]
        if vendor:
            if upstream is None:
                raise typer.BadParameter("--vendor needs --upstream URL")
            record_vendor(out, items, sampler_factory(upstream, None), max_tokens)
            return
        record_lane(out, items, settings, lane_factory, tokenize_url, max_tokens, level)

    return app


gate_app = build_gate_app()
