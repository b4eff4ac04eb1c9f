"""Fast checks of the Iceberg lake's configuration (the behaviour is proven on the real catalog in
test_iceberg_lake_stack.py): catalog properties, lake selection, the stack's catalog address."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.audit.errors import LakeError
from capture.audit.lake.cli import open_lake
from capture.audit.lake.iceberg import ICEBERG_TABLES, TABLE_PROPERTIES, catalog_properties
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo


def settings(**overrides: object) -> LakeSettings:
    base: dict[str, object] = {
        "s3_endpoint": "http://127.0.0.1:9",
        "s3_access_key": "AK",
        "s3_secret_key": "SK",
        "lake_kind": "iceberg",
        "iceberg_uri": "http://127.0.0.1:8181",
    }
    return LakeSettings(**{**base, **overrides})  # type: ignore[arg-type]


def test_catalog_properties_sign_with_the_s3_credentials_for_seaweedfs() -> None:
    props = catalog_properties(settings())
    assert props["uri"] == "http://127.0.0.1:8181"
    assert props["warehouse"] == "s3://reprolane-tables/"
    assert props["rest.sigv4-enabled"] == "true"
    assert props["rest.signing-name"] == "s3tables"
    assert props["client.access-key-id"] == props["s3.access-key-id"] == "AK"
    assert props["s3.endpoint"] == "http://127.0.0.1:9"


def test_a_production_catalog_can_take_a_token_instead_of_sigv4() -> None:
    props = catalog_properties(settings(iceberg_sigv4=False, iceberg_token="tok", iceberg_warehouse="prod"))
    assert props["token"] == "tok"
    assert props["warehouse"] == "prod"
    assert "rest.sigv4-enabled" not in props


def test_no_catalog_url_is_a_lake_error() -> None:
    with pytest.raises(LakeError, match="ICEBERG_URI"):
        catalog_properties(settings(iceberg_uri=None))


def test_the_lake_kind_selects_the_lake_and_parquet_stays_the_default() -> None:
    assert isinstance(open_lake(settings(lake_kind="parquet")), Lake)
    assert LakeSettings().lake_kind == "parquet"
    with pytest.raises(ValueError, match="lake_kind"):
        settings(lake_kind="delta")


def test_our_tables_turn_pyiceberg_s_blind_retry_off_and_carry_the_tenant() -> None:
    assert TABLE_PROPERTIES["commit.retry.num-retries"] == "0"  # a retry must run the anti-join again
    for schema, key, when in ICEBERG_TABLES.values():
        assert {"tenant", key, when, "archived_at"} <= set(schema.names)


def test_the_stack_hands_its_catalog_to_the_archiver(tmp_path: Path) -> None:
    info = StackInfo(
        run_dir=tmp_path, kafka_bootstrap="127.0.0.1:1", kafka_storage="memory", s3_endpoint="http://127.0.0.1:2",
        s3_access_key="a", s3_secret_key="s", s3_region="us-east-1", audit_bucket="b", tansu_bucket="t",
        vllm_url=None, model_name="m", model_dir=None, iceberg_url="http://127.0.0.1:3",
    )  # fmt: skip
    assert stack_defaults(info)["REPROLANE_ARCHIVER_ICEBERG_URI"] == "http://127.0.0.1:3"
    assert "REPROLANE_ARCHIVER_ICEBERG_URI" not in stack_defaults(info.model_copy(update={"iceberg_url": None}))
