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
