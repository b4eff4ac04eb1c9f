"""The ``reprolane`` command line: a root Typer app that other packages add their sub-apps to.

To add a command or a command group, write it (a function, or a Typer app) in its own module and add one line
to `COMMANDS`. Errors are reported the same way everywhere by
:class:`OneLineErrors`: one line on stderr, ``reprolane: error: ...``; exit code 2 for usage errors
(bad option, unknown command or server), 1 for an :class:`~infra.errors.InfraError` (something could
not be done). Tracebacks are for bugs only.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from infra.errors import InfraError
from infra.stack_env import apply_to_process

#: Every command, by the order ``--help`` lists them: name -> (module, attribute, kind). Modules are imported
#: only when their command runs (or ``--help`` describes it), so ``reprolane capture serve`` does not carry the
#: replayer, DuckDB and pyarrow in its memory, and each command starts in a fraction of the time. A ``group`` is
#: a Typer sub-app; a ``command`` is a plain function registered under that name.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "model": ("infra.model_cli", "model_app", "group"),
    "stack": ("infra.stack_cli", "stack_app", "group"),
    "demo": ("infra.demo_cli", "demo_command", "command"),
    "fingerprint": ("infra.fingerprint_cli", "fingerprint_app", "group"),
    "schemas": ("infra.schemas_cli", "schemas_app", "group"),
    "capture": ("capture.cli", "capture_app", "group"),
    "replayer": ("replayer.cli", "replayer_app", "group"),
    "replay": ("replayer.cli", "replay_app", "group"),
    "explain": ("replayer.matrix.cli", "explain_command", "command"),
    "matrix": ("replayer.matrix.cli", "matrix_command", "command"),
    "gate": ("infra.gate_cli", "gate_app", "group"),
    "verify": ("capture.audit.cli", "verify_command", "command"),
    "hold": ("capture.audit.cli", "hold_app", "group"),
    "expire": ("capture.audit.cli", "expire_command", "command"),
    "audit": ("capture.audit.cli", "audit_app", "group"),
    "archiver": ("capture.audit.lake_cli", "archiver_app", "group"),
    "lake": ("capture.audit.lake_cli", "lake_app", "group"),
    "query": ("capture.audit.lake_cli", "query_command", "command"),
    "keys": ("capture.audit.lake_cli", "keys_app", "group"),
}


def load_command(name: str) -> Any:
    """Import one command and return it as a click command named `name`."""
    module, attr, kind = COMMANDS[name]
    target = getattr(importlib.import_module(module), attr)
    if kind == "group":
        return typer.main.get_group(target)
    holder = typer.Typer()
    holder.command(name)(target)
    return typer.main.get_command(holder)


class OneLineErrors(TyperGroup):
    """Root command group: loads the commands of `COMMANDS` on demand, and turns usage errors and InfraErrors
    into one line on stderr."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in COMMANDS if name not in self.commands)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            command = load_command(cmd_name)
            command.name = cmd_name
            self.commands[cmd_name] = command
        return super().get_command(ctx, cmd_name)

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


@app.callback()
def _root() -> None:
    """Audit capture and deterministic replay for LLM inference."""
