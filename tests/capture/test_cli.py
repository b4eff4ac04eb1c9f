"""`capture.cli`: settings from flags, and the process-wide tuning `serve` applies before serving."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.cli import GC_GEN0_THRESHOLD, build_settings, build_spool, tune_gc
from capture.errors import CaptureError


@pytest.fixture
def restored_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_tune_gc_freezes_start_up_objects_and_enlarges_the_young_generation(restored_gc: None) -> None:
    gc.unfreeze()
    made_at_start_up = [{"setting": i} for i in range(1000)]  # stands for modules, settings, the app
    tune_gc()
    assert gc.get_freeze_count() >= len(made_at_start_up)
    assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD > 700


def test_s3_processes_flag_reaches_the_settings() -> None:
    settings = build_settings(upstream="http://127.0.0.1:9", spool_dir=Path("x"), s3_processes=3)
    assert settings.s3_processes == 3
    with pytest.raises(CaptureError, match="s3_processes"):
        build_settings(upstream="http://127.0.0.1:9", s3_processes=-1)


def test_only_best_effort_spools_linger(tmp_path: Path) -> None:
    def spool(**flags: object) -> float:
        return build_spool(build_settings(upstream="http://127.0.0.1:9", spool_dir=tmp_path, **flags)).writer.linger_s

    assert spool(mode="best_effort") == 0.010  # the default: one fsync per 10 ms, whatever the rate
    assert spool(mode="guaranteed") == 0.0  # clients wait for the fsync: never an added wait
    assert spool(mode="best_effort", best_effort_linger_ms=0) == 0.0


def test_every_serve_option_sets_its_settings_field(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The options are written once, under the field each sets; the flags whose form is not the setting's are
    converted (repeatable lists, NAME=PATH, JSON), and a bad value is one line and exit 2."""
    from typer.testing import CliRunner

    from capture import cli
    from capture.settings import CaptureSettings

    assert set(cli.OPTIONS) <= set(CaptureSettings.model_fields)
    served: list[CaptureSettings] = []
    monkeypatch.setattr(cli, "serve", served.append)
    args = ["serve", "--upstream", "http://up:8000", "--port", "8111", "--flag-tenant", "a", "--flag-tenant", "b"]
    args += ["--lora-module", f"tone={tmp_path}", "--no-inject-seed", "--manifest", str(tmp_path / "m.json")]
    args += ["--upstream-override-generation-config", '{"temperature": 0.5}', "--trusted-proxy", "10.0.0.0/8"]
    result = CliRunner().invoke(cli.capture_app, args)
    assert result.exit_code == 0, result.output
    (settings,) = served
    assert (settings.upstream, settings.port, settings.flag_tenants) == ("http://up:8000", 8111, ("a", "b"))
    assert settings.lora_modules == {"tone": tmp_path}
    assert settings.inject_seed is False
    assert settings.manifest_path == tmp_path / "m.json"
    assert settings.upstream_override_generation_config == {"temperature": 0.5}
    assert [str(n) for n in settings.trusted_proxies] == ["10.0.0.0/8"]
    bad = CliRunner().invoke(cli.capture_app, ["serve", "--upstream-override-generation-config", "{not json"])
    assert bad.exit_code == 2
    assert "--upstream-override-generation-config: not JSON" in bad.output
