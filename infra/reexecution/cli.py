"""``reprolane audit evidence``, whole: the audit side's ``export`` (with ``--reexecutable``, which reads the
replayer's schedule store), ``verify`` and ``key`` (`capture.audit.evidence.cli`), and ``reexecute``.

Exit codes of ``reexecute`` (through `infra.cli`): 0 the request was reproduced bit for bit in its recorded
schedule; 1 it was not (the report shows the first divergent token and the top-k on both sides), or the bundle
fails its check (the part named) or is not re-executable; 2 this machine cannot replay it (a model file or a
numeric field of the runtime differs: each named), bad arguments, a file that is no bundle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from capture.audit.evidence.cli import KeyFingerprintOpt, KeyOpt, build_evidence_app, pinned_bundle
from capture.audit.evidence.export import ExtraMembers


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


@evidence_app.command("reexecute")
def reexecute_cmd(
    bundle: Annotated[Path, typer.Argument(help="a bundle exported with --reexecutable")],
    model_dir: Annotated[Path, typer.Option("--model-dir", help="the model files, as the bundle's manifest lists")],
    key: KeyOpt = None,
    key_fingerprint_: KeyFingerprintOpt = None,
) -> None:
    """Re-execute a bundle offline: check it, the model files and this runtime; replay; say if it is bit for bit.

    Example: reprolane audit evidence reexecute evidence.zip --model-dir smollm2 --key-fingerprint sha256:ab12
    """
    from infra.reexecution.run import reexecute
    from replayer.machine_output import machine_output
    from replayer.report import render_request

    data, pin = pinned_bundle(bundle, key, key_fingerprint_)
    with machine_output(True) as document:  # the verdict alone on stdout: the engine's logs on stderr
        done = reexecute(data, pin, model_dir)
        verdict = (
            f"reproduced bit for bit: request {done.envelope.request_id}, "
            f"{len(done.result.replayed.token_ids)} tokens and their logprobs, in its recorded schedule"
            if done.reproduced
            else f"NOT reproduced: request {done.envelope.request_id}\n"
            + render_request(done.envelope, done.result).rstrip("\n")
        )
        document("\n".join([*done.report.lines, verdict]))
    raise typer.Exit(0 if done.reproduced else 1)
