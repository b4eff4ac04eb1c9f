"""``reprolane demo``: run the whole pipeline on the local stack with a bundled workload (see `infra.demo.run`).

A single command (`infra.cli.commands.TREE`'s ``demo``), not a group.
"""

from __future__ import annotations

from typing import Annotated

import typer

from infra.cli_options import RunDirOpt


def demo_command(
    run_dir: RunDirOpt = None,
    quick: Annotated[bool, typer.Option("--quick", help="6 prompts, one 2-step workflow, 12 tokens")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="leave the sidecar, the replayer and the stack running")] = False,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="seconds to wait for the next replay")] = 300.0,
    sample_rate: Annotated[
        float, typer.Option("--sample-rate", min=0.0, max=1.0, help="fraction of requests the sidecar samples")
    ] = 0.34,
    console: Annotated[
        bool, typer.Option("--console", help="start the auditors' console for the run and serve it until Ctrl-C")
    ] = False,
) -> None:
    """Start the stack, the capture sidecar and the replayer; drive a workload; print what diverged and how to
    open the auditors' console for the run.

    Example: reprolane demo --quick --console
    """
    from infra.demo.run import DemoOptions, run_demo  # imported here: `reprolane --help` stays fast

    options = DemoOptions(
        run_dir=run_dir, quick=quick, keep=keep, timeout_s=timeout, sample_rate=sample_rate, console=console
    )
    try:
        run_demo(options, lambda line: typer.echo(line))
    except KeyboardInterrupt:  # run_demo stopped what it started before this reaches here
        typer.echo("reprolane: interrupted; everything the demo started has been stopped", err=True)
        raise typer.Exit(130) from None
