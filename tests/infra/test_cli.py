"""CLI contract: usage errors are one line on stderr with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli import app


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
    """`reprolane capture ...` must not import the replayer, DuckDB, pyarrow or torch (memory of the sidecar)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from infra.cli import app\n"
        "try:\n    app(['capture', 'serve', '--help'])\n"
        "except SystemExit:\n    pass\n"
        "names = ('replayer.cli', 'duckdb', 'pyarrow', 'torch', 'capture.audit.lake')\n"
        "heavy = [m for m in names if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert "HEAVY []" in out.stdout, out.stdout[-500:]


def test_every_registered_command_loads() -> None:
    from infra.cli import COMMANDS, load_command

    for name in COMMANDS:
        assert load_command(name) is not None, name
