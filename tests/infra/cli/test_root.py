"""CLI contract: the root's error boundary. Whatever a command raises is one line on stderr, ``reprolane: error:
...``, with the exit code of its error tree (2: usage, settings, contract, unknown id, every replayer error;
1: the other packages' errors), never a traceback; anything outside those trees is a bug and keeps its traceback."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from capture.audit.errors import AuditError, AuditStoreError, LakeError, SigningKeyError, UnknownIdError
from capture.errors import CaptureError, SinkError
from capture.ledger.errors import KeyringError, LedgerStoreError
from infra.cli.root import app, build_app
from infra.errors import InfraError, ModelCacheError, StackNotRunningError
from replayer.errors import EnvelopeNotFoundError, GateInputError, NotReplayableError, ReplayerError, StoreError
from replayer.settings import ReplayerSettings
from schemas import ContractError
from schemas.errors import ReprolaneError, SealError


def _invalid_settings() -> None:
    ReplayerSettings(num_threads=0, lane="tpu")  # type: ignore[arg-type]


def _raise(exc: Exception) -> Callable[[], None]:
    def command() -> None:
        raise exc

    return command


#: name -> (what the command does, the exit code, a piece of the one line on stderr)
RAISED: dict[str, tuple[Callable[[], None], int, str]] = {
    "bad-parameter": (
        _raise(typer.BadParameter("--thing must be round")),
        2,
        "reprolane: error: --thing must be round",
    ),
    "bad-parameter-hint": (
        _raise(typer.BadParameter("must be round", param_hint="'--thing'")),
        2,
        "reprolane: error: Invalid value for '--thing': must be round",
    ),
    "validation": (_invalid_settings, 2, "reprolane: error: invalid ReplayerSettings: lane: "),
    "contract": (_raise(ContractError("invalid envelope: tenant: bad")), 2, "reprolane: error: invalid envelope"),
    "seal": (_raise(SealError("the record does not open with this key")), 2, "does not open with this key"),
    "unknown-id": (_raise(UnknownIdError("no envelope req-1")), 2, "reprolane: error: no envelope req-1"),
    "signing-key": (_raise(SigningKeyError("no signing key")), 2, "reprolane: error: no signing key"),
    "envelope-not-found": (_raise(EnvelopeNotFoundError("no envelope is indexed")), 2, "no envelope is indexed"),
    "not-replayable": (_raise(NotReplayableError("shredded")), 2, "reprolane: error: shredded"),
    "gate-input": (_raise(GateInputError("cannot read golden set")), 2, "cannot read golden set"),
    "replayer-store": (_raise(StoreError("S3 is down")), 2, "reprolane: error: S3 is down"),
    "replayer": (_raise(ReplayerError("no verdict")), 2, "reprolane: error: no verdict"),
    "infra": (_raise(InfraError("could not")), 1, "reprolane: error: could not"),
    "infra-stack": (_raise(StackNotRunningError("no stack in /x")), 1, "reprolane: error: no stack in /x"),
    "infra-model": (_raise(ModelCacheError("hash mismatch")), 1, "reprolane: error: hash mismatch"),
    "capture": (_raise(CaptureError("spool held")), 1, "reprolane: error: spool held"),
    "capture-sink": (_raise(SinkError("Kafka refused")), 1, "reprolane: error: Kafka refused"),
    "capture-lake": (_raise(LakeError("lake unreadable")), 1, "reprolane: error: lake unreadable"),
    "audit": (_raise(AuditError("audit failed")), 1, "reprolane: error: audit failed"),
    "audit-store": (_raise(AuditStoreError("S3 refused")), 1, "reprolane: error: S3 refused"),
    "ledger-keys": (_raise(KeyringError("no KEK")), 1, "reprolane: error: no KEK"),
    "ledger-store": (_raise(LedgerStoreError("S3 down")), 1, "reprolane: error: S3 down"),
    "abort": (_raise(typer.Abort()), 1, "reprolane: error: aborted"),
}


def _raising_app() -> typer.Typer:
    """The root with its ``replayer`` source (`infra.cli.commands.SOURCES`, a whole group under its old spelling)
    replaced by one whose commands raise the errors of `RAISED`."""
    sub = typer.Typer()
    for name, (command, _, _) in RAISED.items():
        sub.command(name)(command)
    return build_app({"replayer": sub})


@pytest.mark.parametrize("name", list(RAISED))
def test_each_error_tree_is_one_line_and_its_exit_code(name: str) -> None:
    _, code, needle = RAISED[name]
    result = CliRunner().invoke(_raising_app(), ["replayer", name])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("reprolane: error: ")
    assert needle in lines[0]
    assert result.stdout == ""


def test_a_validation_error_names_every_field_on_one_line() -> None:
    result = CliRunner().invoke(_raising_app(), ["replayer", "validation"])
    (line,) = result.stderr.strip().splitlines()
    assert "lane: " in line
    assert "; num_threads: " in line


def test_a_verdict_exits_with_its_code_and_no_error_line() -> None:
    sub = typer.Typer()

    @sub.command("diverged")
    def diverged() -> None:
        typer.echo("Verdict: diverged")
        raise typer.Exit(1)

    result = CliRunner().invoke(build_app({"replayer": sub}), ["replayer", "diverged"])
    assert result.exit_code == 1
    assert result.stdout == "Verdict: diverged\n"
    assert result.stderr == ""


def test_an_error_outside_the_trees_is_a_bug_and_keeps_its_traceback() -> None:
    sub = typer.Typer()

    @sub.command("bug")
    def bug() -> None:
        raise RuntimeError("a bug")

    result = CliRunner().invoke(build_app({"replayer": sub}), ["replayer", "bug"])
    assert isinstance(result.exception, RuntimeError)
    assert "reprolane: error:" not in result.stderr


def test_a_message_with_a_log_tail_keeps_it_after_the_error_line() -> None:
    sub = typer.Typer()
    sub.command("start")(_raise(InfraError("vllm exited during start-up; last lines of vllm.log:\nOOM")))
    result = CliRunner().invoke(build_app({"replayer": sub}), ["replayer", "start"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "reprolane: error: vllm exited during start-up; last lines of vllm.log:",
        "OOM",
    ]


def test_a_command_override_replaces_a_plain_command_wherever_the_tree_uses_it() -> None:
    overridden = build_app({"query": _raise(UnknownIdError("no day 2026-01-01"))})
    for path in (["audit", "query"], ["query"]):  # its place in the tree, and its old spelling
        result = CliRunner().invoke(overridden, path)
        assert result.exit_code == 2
        assert result.stderr == "reprolane: error: no day 2026-01-01\n"
    with pytest.raises(KeyError, match="no command source 'nonsense'"):
        build_app({"nonsense": typer.Typer()})


def test_help_exits_0_and_no_arguments_print_the_help_with_exit_2() -> None:
    helped = CliRunner().invoke(app, ["--help"])
    assert helped.exit_code == 0
    assert "replay" in helped.stdout
    bare = CliRunner().invoke(app, [])
    assert bare.exit_code == 2
    assert "Usage" in bare.output
    group = CliRunner().invoke(app, ["stack"])
    assert group.exit_code == 2
    assert "Usage" in group.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["nonsense"], "No such command"),
        (["stack", "up", "--kafka-storage", "tape"], "--kafka-storage"),
        (["model", "fetch", "--bogus"], "No such option"),
    ],
)
def test_usage_errors_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("reprolane: error:")
    assert needle in lines[0]


def test_status_without_a_stack_exits_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["stack", "status", "--run-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "no stack in" in result.stderr


def test_commands_load_lazily_so_the_sidecar_stays_small() -> None:
    """`reprolane serve capture` must not import the replayer, DuckDB, pyarrow or torch (memory of the sidecar)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from infra.cli.root import app\n"
        "try:\n    app(['serve', 'capture', '--help'])\n"
        "except SystemExit:\n    pass\n"
        "names = ('replayer.cli', 'duckdb', 'pyarrow', 'torch', 'capture.audit.lake.store')\n"
        "heavy = [m for m in names if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_every_source_loads() -> None:
    from infra.cli.commands import SOURCES, Cmd
    from infra.cli.root import load_command

    for name in SOURCES:
        assert load_command(Cmd(name)) is not None, name


@pytest.mark.parametrize(
    "module",
    [
        "schemas.errors",
        "capture.errors",
        "capture.audit.errors",
        "capture.ledger.errors",
        "replayer.errors",
        "infra.errors",
    ],
)
def test_every_error_tree_hangs_below_the_project_root_with_its_exit_code(module: str) -> None:
    """The exit code is derived from the tree (`ReprolaneError.exit_code`), so a new error class needs no list."""
    loaded = importlib.import_module(module)
    classes = [c for c in vars(loaded).values() if isinstance(c, type) and c.__module__ == module]
    assert classes
    for cls in classes:
        assert issubclass(cls, ReprolaneError), cls
        assert cls.exit_code in (1, 2), cls
