"""`reprolane schemas export`: the JSON Schemas validate real records and reject bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from infra.cli.root import app
from tests.factories import envelope

runner = CliRunner()


def test_export_writes_schemas_that_validate_records(tmp_path: Path) -> None:
    result = runner.invoke(app, ["schemas", "export", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "envelope.v1.schema.json" in names
    assert "divergence-event.v1.schema.json" in names
    schema = json.loads((tmp_path / "out" / "envelope.v1.schema.json").read_text())
    record = json.loads(envelope().canonical())
    jsonschema.validate(record, schema)
    record["sampling"]["temprature"] = 1.0
    with pytest.raises(jsonschema.ValidationError, match="temprature"):
        jsonschema.validate(record, schema)


def test_export_onto_a_file_is_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    result = runner.invoke(app, ["schemas", "export", str(f)])
    assert result.exit_code == 2
    assert "not a directory" in result.output
