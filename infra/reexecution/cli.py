"""``reprolane audit evidence``, whole: the audit side's ``export`` (with ``--reexecutable``, which reads the
replayer's schedule store), ``verify`` and ``key`` (`capture.audit.evidence.cli`), and ``reexecute``.

``reexecute`` takes one bundle or several (a workflow's folder, as ``export --workflow`` writes it): each is
checked before any runs, and the bundles of one recorded engine share one lane. Exit codes (through
`infra.cli`): 0 every request was reproduced bit for bit in its recorded schedule; 1 one was not (the report
shows the first divergent token and the top-k on both sides), or a bundle fails its check (the part named) or is
not re-executable; 2 this machine cannot replay them (a model file or a numeric field of the runtime differs: each
named), bad arguments, a file that is no bundle.

With ``--json`` it prints one JSON document instead of the text, shaped as ``replay workflow --json``'s: under
``requests``, one entry per bundle in the order run, holding the bundle's path, the request id, whether it was
reproduced bit for bit, which engine started here replayed it, and as ``result`` the document ``replay request
--json`` prints for a replay; beside it ``engines``, how many engines were started. The exit codes are the same;
a command that fails before any verdict prints no document (the error is on stderr, as without ``--json``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from capture.audit.evidence.cli import KeyFingerprintOpt, KeyOpt, build_evidence_app, pinned_bundle
from capture.audit.evidence.export import ExtraMembers

if TYPE_CHECKING:
    from infra.reexecution.run import Reexecuted


def _members() -> ExtraMembers:
    """``export --reexecutable``'s members, read with the replayer's settings (``REPROLANE_REPLAYER_*``: its S3,
    where the schedule shipper writes; the model directory the deployment serves)."""
    from infra import paths
    from infra.reexecution.export import reexecutable_members
    from replayer.schedule.store import ScheduleStore
    from replayer.settings import ReplayerSettings

    settings = ReplayerSettings()
    return reexecutable_members(ScheduleStore.from_settings(settings), settings.model_dir or paths.model_dir())


evidence_app = build_evidence_app(reexecutable=_members)


def _bundle_files(paths: list[Path]) -> list[Path]:
    """The bundles named: files as given, a folder (``export --workflow``'s) as its ``*.zip`` in name order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(path.glob("*.zip"))
            if not found:
                raise typer.BadParameter(f"{path}: a folder with no bundle (*.zip) in it")
            files += found
        else:
            files.append(path)
    return files


@evidence_app.command("reexecute")
def reexecute_cmd(
    bundles: Annotated[
        list[Path], typer.Argument(help="bundles exported with --reexecutable, or the folder of a workflow's")
    ],
    model_dir: Annotated[Path, typer.Option("--model-dir", help="the model files, as the bundle's manifest lists")],
    key: KeyOpt = None,
    key_fingerprint_: KeyFingerprintOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the verdicts and replay results as JSON")] = False,
) -> None:
    """Re-execute bundles offline: check each, the model files and this runtime; replay; say if each is bit for bit.

    Example: reprolane audit evidence reexecute evidence.zip --model-dir smollm2 --key-fingerprint sha256:ab12
    """
    from infra.reexecution.run import reexecute_all
    from replayer.machine_output import machine_output

    files = _bundle_files(bundles)
    pinned = [pinned_bundle(path, key, key_fingerprint_) for path in files]
    with machine_output(True) as document:  # the verdicts alone on stdout: the engine's logs on stderr
        done = reexecute_all([data for data, _ in pinned], pinned[0][1], model_dir)
        engines = len({one.engine for one in done})
        if as_json:
            document(json.dumps(_json(files, done, engines), indent=2, ensure_ascii=False))
        else:
            document(_text(done, engines))
    raise typer.Exit(0 if all(one.reproduced for one in done) else 1)


def _text(done: Sequence[Reexecuted], engines: int) -> str:
    """The report a person reads: each bundle's check, then its verdict (a divergence shown as ``replay request``
    shows it); last, how many requests ran on how many engines."""
    from replayer.report import render_request

    lines: list[str] = []
    for one in done:
        lines += one.report.lines
        lines.append(
            f"reproduced bit for bit: request {one.envelope.request_id}, "
            f"{len(one.result.replayed.token_ids)} tokens and their logprobs, in its recorded schedule"
            if one.reproduced
            else f"NOT reproduced: request {one.envelope.request_id}\n"
            + render_request(one.envelope, one.result).rstrip("\n")
        )
    lines.append(f"{len(done)} request(s) re-executed on {engines} engine(s) started here")
    return "\n".join(lines)


def _json(files: Sequence[Path], done: Sequence[Reexecuted], engines: int) -> dict[str, Any]:
    """The ``--json`` document (module doc): `done` is in the order of `files`, as `reexecute_all` returns it."""
    return {
        "engines": engines,
        "requests": [
            {
                "bundle": str(path),
                "request_id": one.envelope.request_id,
                "reproduced": one.reproduced,
                "engine": one.engine,
                "result": one.result.model_dump(mode="json"),
            }
            for path, one in zip(files, done, strict=True)
        ],
    }
