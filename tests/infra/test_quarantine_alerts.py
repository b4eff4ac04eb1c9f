"""The alerts on records the publisher quarantined and on index conflicts exist and fire (issue 18, findings 2
and 4); their promtool unit tests are in infra/prometheus/alerts.test.yml, run by test_deploy_files.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from capture.metrics import CaptureMetrics

PROMETHEUS = Path(__file__).resolve().parents[2] / "infra" / "prometheus"


def test_quarantine_and_index_conflict_alerts_exist_on_the_metrics_the_sidecar_exports() -> None:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    alerts = {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}
    assert "reprolane_capture_records_quarantined_total" in alerts["ReprolaneRecordsQuarantined"]["expr"]
    assert alerts["ReprolaneRecordsQuarantined"]["labels"]["severity"] == "page"
    assert "reprolane_capture_index_conflicts_total" in alerts["ReprolaneIndexConflicts"]["expr"]
    metrics = CaptureMetrics()
    metrics.records_quarantined_total.labels(sink="s3", code="KeyTooLongError").inc()
    metrics.index_conflicts_total.inc()
    text = metrics.render().decode()
    assert 'reprolane_capture_records_quarantined_total{code="KeyTooLongError",sink="s3"} 1.0' in text
    assert "reprolane_capture_index_conflicts_total 1.0" in text


def test_their_promtool_unit_tests_pass() -> None:
    tool = shutil.which("promtool")
    assert tool, "promtool not found: install Debian's `prometheus` package (apt-get install prometheus)"
    done = subprocess.run([tool, "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ReprolaneRecordsQuarantined" in (PROMETHEUS / "alerts.test.yml").read_text(encoding="utf-8")
