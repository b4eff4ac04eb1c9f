"""The demo's console logins (`infra.demo.services.write_console_logins`) and what the demo prints about them
(`infra.demo.run.console_lines`), without a stack; tests/infra/demo/test_run.py logs in to the console the demo
starts."""

from __future__ import annotations

import stat
from pathlib import Path

from infra.console.operators import OperatorKeys
from infra.demo.run import CONSOLE_PORT, console_lines
from infra.demo.services import write_console_logins


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_run_mints_a_viewer_and_a_hold_admin_key_that_the_console_accepts(tmp_path: Path) -> None:
    first = write_console_logins(tmp_path / "demo")
    old_key = first.key_files["viewer"].read_text().strip()
    again = write_console_logins(tmp_path / "demo")  # a second run replaces the first run's keys
    assert _mode(again.keys_path) == 0o600
    keys = OperatorKeys.load(again.keys_path)
    for role, path in again.key_files.items():
        assert _mode(path) == 0o600
        operator = keys.prove(path.read_text().strip())
        assert operator is not None
        assert operator.roles == {role}
        assert operator.tenant is None
        assert operator.may("viewer")  # both may log in and read
    assert set(again.key_files) == {"viewer", "hold-admin"}
    assert keys.prove(old_key) is None  # the earlier run's login is gone
    hold_admin = keys.prove(again.key_files["hold-admin"].read_text().strip())
    viewer = keys.prove(again.key_files["viewer"].read_text().strip())
    assert hold_admin is not None
    assert hold_admin.may("hold-admin")
    assert viewer is not None
    assert not viewer.may("hold-admin")


def test_the_demo_prints_how_to_open_the_console_with_the_runs_keys(tmp_path: Path) -> None:
    logins = write_console_logins(tmp_path / "demo")
    text = "\n".join(console_lines(tmp_path / "stack", logins, None, stack_stops=True))
    assert f"REPROLANE_RUN_DIR={tmp_path / 'stack'} " in text
    assert f"REPROLANE_OPERATOR_KEYS_PATH={logins.keys_path} reprolane serve console" in text
    assert f"http://127.0.0.1:{CONSOLE_PORT}/" in text
    assert str(logins.key_files["viewer"]) in text
    assert str(logins.key_files["hold-admin"]) in text
    assert "reprolane demo --console" in text
    assert "reprolane stack up" in text
    started = "\n".join(console_lines(tmp_path / "stack", logins, "http://127.0.0.1:12345/", stack_stops=False))
    assert "serves this run at http://127.0.0.1:12345/" in started
    assert "stack up" not in started
