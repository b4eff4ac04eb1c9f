"""The ``reprolane`` command line: the root Typer app, and the one place where an error becomes an exit code.

The commands and their places are written once, in `infra.cli.commands` (to add one: write it in its module, add
one line to its tree). A command never prints an error or exits by itself: it raises. `OneLineErrors` (the root group)
turns what it raises into one line on stderr, ``reprolane: error: <message>``, and the exit code of its tree:
every error raised on purpose is a ``schemas.errors.ReprolaneError`` and carries its code (`exit_code`):

    exit  what the command raised
    2     a usage error: ``typer.BadParameter`` (a command's "bad input"), or typer's own (unknown command or
          option, bad option value, missing argument)
    2     ``pydantic.ValidationError``: settings from flags and environment, named per field
          (``invalid ReplayerSettings: lane: ...; s3_bucket: ...``)
    2     the caller's input at fault: ``schemas.ContractError`` and ``SealError``; the audit jobs'
          ``UnknownIdError`` (no envelope, workflow or day of that name), ``SigningKeyError`` (a key file missing
          or unreadable), ``AccessDenied`` (an operator command refused: no operator key, the role missing, the
          tenant out of the key's scope)
    2     ``replayer.errors.ReplayerError``, every one: ``EnvelopeNotFoundError``, ``NotReplayableError``,
          ``GateInputError``, ``LaneUnavailableError``, ``StoreError``
    1     the rest of each package's tree: ``infra.errors.InfraError``, ``capture.errors.CaptureError``
          (``SinkError``, ...), ``capture.audit.errors.AuditError`` (``LakeError``, ``AuditStoreError``, ...),
          ``capture.ledger.errors.LedgerError`` (``KeyringError``, ...)
    1     ``typer.Abort``

Every replayer command ends in a verdict whose "no" is exit 1 (replay diverged, the gate failed, a matrix cell
failed, no variation reproduced the capture), so a replayer error, whatever its cause, means "no verdict" and
is 2: a release pipeline must not read "S3 was down" as "the candidate diverged". The other packages' errors
mean "could not be done" and are 1. A verdict itself is ``raise typer.Exit(code)`` in the command (verify not
ok, gate failed, replay diverged, a stack server not ready), and Ctrl-C is 130 (typer). A message with more
than one line (a server's log tail) keeps its further lines after the error line. ``--help`` and a group
called without a command print the help (exit 0 and 2). Anything else is a bug, and keeps its traceback.

`build_app` makes the root app; tests pass it sub-apps built with injected factories (a fake lane, a moto store)
so that what they invoke goes through this same boundary.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

from infra.cli.commands import SOURCES, TREE, Cmd, Group
from infra.stack.env import apply_to_process
from replayer.machine_output import engine_logs_to_stderr
from schemas import ContractError
from schemas.errors import ReprolaneError


def exit_code(exc: Exception) -> int | None:
    """The exit code of `exc`: its tree's (`schemas.errors.ReprolaneError.exit_code`), 2 for settings that do not
    validate, None for anything else (a bug: its traceback is kept)."""
    if isinstance(exc, ValidationError):
        return 2
    return exc.exit_code if isinstance(exc, ReprolaneError) else None


def error_message(exc: Exception) -> str:
    """What follows ``reprolane: error:`` for `exc`: settings errors name each field, the rest say themselves."""
    if isinstance(exc, ValidationError):
        return str(ContractError.from_validation(exc.title, exc))
    if isinstance(exc, typer.BadParameter) and exc.param is None and exc.param_hint is None:
        return exc.message  # a command's own sentence, which names the option itself
    if isinstance(exc, typer.TyperException):
        return exc.format_message()
    return str(exc)


def load_command(spec: Cmd, sources: Mapping[str, Any] | None = None) -> Any:
    """Import one command of the tree (`infra.cli.commands.Cmd`) and return it as a click command; ``sources``
    replace `SOURCES` entries by name."""
    if sources is not None and spec.source in sources:
        target = sources[spec.source]
    else:
        module, attr = SOURCES[spec.source]
        target = getattr(importlib.import_module(module), attr)
    if isinstance(target, typer.Typer):
        group = typer.main.get_group(target)
        return group if spec.sub is None else group.commands[spec.sub]
    holder = typer.Typer(add_completion=False)  # the root has no completion options: nor have its commands
    holder.command(spec.source)(target)
    return typer.main.get_command(holder)


class LazyGroup(TyperGroup):
    """A group of `infra.cli.commands.TREE`: lists its node's commands and loads each on first use; old spellings
    (`Group.hidden`) answer too, unlisted."""

    node: Group = TREE
    sources: Mapping[str, Any] = {}

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.node.children)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in self.commands:
            spec = self.node.children.get(cmd_name) or self.node.hidden.get(cmd_name)
            if spec is None:
                return None
            if isinstance(spec, Group):
                command: Any = LazyGroup(name=cmd_name, help=spec.help, no_args_is_help=True)
                command.node, command.sources = spec, self.sources
            else:
                command = load_command(spec, self.sources)
                command.name = cmd_name
            command.hidden = cmd_name not in self.node.children
            self.commands[cmd_name] = command
        return self.commands[cmd_name]


class OneLineErrors(LazyGroup):
    """Root command group (`infra.cli.commands.TREE`): turns what its commands raise into one line on stderr and the
    exit code of its tree (`exit_code`)."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        apply_to_process()  # a running local stack provides defaults for the services' settings
        engine_logs_to_stderr(os.environ)  # stdout is the commands' output, never an engine's log
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as exc:  # typer's vendored click errors all derive from it
            if type(exc).__name__ == "NoArgsIsHelpError":  # its message is the whole help text
                typer.echo(exc.format_message(), err=True)
                sys.exit(2)
            _fail(error_message(exc), exc.exit_code)  # usage errors carry exit_code 2
        except typer.Abort:
            _fail("aborted", 1)
        except Exception as exc:
            mapped = exit_code(exc)
            if mapped is None:
                raise
            _fail(error_message(exc), mapped)
        sys.exit(code if isinstance(code, int) else 0)


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"reprolane: error: {message}", err=True)
    sys.exit(code)


def _root() -> None:
    """Audit capture and deterministic replay for LLM inference."""


def build_app(overrides: Mapping[str, Any] | None = None) -> typer.Typer:
    """The ``reprolane`` app. `overrides` replace entries of `infra.cli.commands.SOURCES` by name, wherever the tree
    uses them: a Typer sub-app for an app, a function for a command (tests pass sub-apps built with injected
    factories)."""
    unknown = sorted(set(overrides or {}) - set(SOURCES))
    if unknown:
        raise KeyError(f"no command source {unknown[0]!r} to override; sources: {', '.join(SOURCES)}")
    root = type("Root", (OneLineErrors,), {"sources": dict(overrides or {})})
    app = typer.Typer(
        cls=root,
        name="reprolane",
        help=TREE.help,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )
    app.callback()(_root)
    return app


app = build_app()
