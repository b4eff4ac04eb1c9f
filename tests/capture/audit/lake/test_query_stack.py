"""`reprolane audit query` over the real SeaweedFS lake: the lake's views answer, a query that reaches for a file is
refused with exit 2 (bad input) and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from capture.audit.lake.archiver import Archiver
from infra.cli.root import build_app
from tests.capture.audit.conftest import AuditStack
from tests.factories import envelope

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]


async def test_query_reads_the_lake_and_refuses_files(audit_stack: AuditStack, tmp_path: Path) -> None:
    a = audit_stack
    archiver = Archiver(a.lake_settings(), a.lake())
    archiver.add(a.envelope_topic, envelope(request_id=f"q-{a.suffix}", tenant=f"t-{a.suffix}").canonical())
    await archiver.flush()
    env = {
        "REPROLANE_ARCHIVER_S3_ENDPOINT": a.info.s3_endpoint,
        "REPROLANE_ARCHIVER_S3_ACCESS_KEY": a.info.s3_access_key,
        "REPROLANE_ARCHIVER_S3_SECRET_KEY": a.info.s3_secret_key,
        "REPROLANE_ARCHIVER_LAKE_BUCKET": a.bucket,
        "REPROLANE_ARCHIVER_LAKE_PREFIX": a.prefix,
    }
    app = build_app()
    ok = CliRunner().invoke(app, ["audit", "query", "SELECT request_id FROM envelopes", "--csv"], env=env)
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.splitlines() == ["request_id", f"q-{a.suffix}"]

    passwd = CliRunner().invoke(app, ["audit", "query", "SELECT * FROM read_text('/etc/passwd')"], env=env)
    assert passwd.exit_code == 2, passwd.output
    assert passwd.stderr.startswith("reprolane: error: query refused: Permission Error")
    assert "root:" not in passwd.stdout

    out = tmp_path / "copied.csv"
    copy = CliRunner().invoke(app, ["audit", "query", f"COPY (SELECT * FROM envelopes) TO '{out}'"], env=env)
    assert copy.exit_code == 2, copy.output
    assert copy.stderr.startswith("reprolane: error: query refused: Permission Error")
    assert not out.exists()
