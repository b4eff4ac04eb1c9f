"""The ``reprolane`` command line: a root Typer app that other packages add their sub-apps to.

To add a command group, write its Typer app in its own module and register it below with
``app.add_typer(sub_app, name="...")``. Errors are reported the same way everywhere by
:class:`OneLineErrors`: one line on stderr, ``reprolane: error: ...``; exit code 2 for usage errors
(bad option, unknown command or server), 1 for an :class:`~infra.errors.InfraError` (something could
not be done). Tracebacks are for bugs only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from capture.cli import capture_app
from infra.errors import InfraError
from infra.fingerprint_cli import fingerprint_app
from infra.model_cli import model_app
from infra.schemas_cli import schemas_app
from infra.stack_cli import stack_app
from infra.stack_env import apply_to_process
from replayer.cli import replay_app, replayer_app


class OneLineErrors(TyperGroup):
    """Root command group that turns usage errors and InfraErrors into one line on stderr."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        apply_to_process()  # a running local stack provides defaults for the services' settings
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as exc:  # typer's vendored click errors all derive from it
            if type(exc).__name__ == "NoArgsIsHelpError":  # its message is the whole help text
                typer.echo(exc.format_message(), err=True)
                sys.exit(2)
            _fail(exc.format_message(), exc.exit_code)  # usage errors carry exit_code 2
        except typer.Abort:
            _fail("aborted", 1)
        except InfraError as exc:
            _fail(str(exc), 1)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"reprolane: error: {message}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=OneLineErrors,
    name="reprolane",
    help="Audit capture and deterministic replay for LLM inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(model_app, name="model")
app.add_typer(stack_app, name="stack")
app.add_typer(fingerprint_app, name="fingerprint")
app.add_typer(schemas_app, name="schemas")
app.add_typer(capture_app, name="capture")
app.add_typer(replayer_app, name="replayer")
app.add_typer(replay_app, name="replay")
