"""S3 access to the stack's SeaweedFS: credentials, its admin client, and the buckets we need.

Three buckets, created idempotently after SeaweedFS is ready:

* ``reprolane-audit``, with Object Lock enabled at creation (S3 cannot turn it on later): audit records
  are written with a COMPLIANCE retention, so not even the writer can delete them before it ends;
* ``reprolane-tansu``, a plain bucket where Tansu keeps topics, offsets and messages, so they survive a
  broker restart;
* ``reprolane-lake`` (`schemas.layout.LAKE_BUCKET`), a plain bucket for the audit lake's Parquet files (compaction
  rewrites them) and the tenants' wrapped data keys (crypto-shredding deletes them): no Object Lock.

If the audit bucket already exists *without* Object Lock (made by hand, or by an older version), that is
an error, not something to paper over: writes would silently lose their WORM guarantee.

The client is `infra.clients.s3`'s, like every service's; boto3 is imported inside functions there, so the CLI's
``--help`` does not pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from infra.clients.connection import S3ConnectionFields
from infra.clients.s3 import S3Policy, make_s3_client
from infra.errors import StackError
from schemas.layout import ICEBERG_TABLE_BUCKET, LAKE_BUCKET

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

AUDIT_BUCKET = "reprolane-audit"
TANSU_BUCKET = "reprolane-tansu"


class S3Credentials(BaseModel):
    """The single admin identity SeaweedFS is started with (from its environment)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def connection(self, endpoint: str) -> S3ConnectionFields:
        """These credentials at ``endpoint`` as the connection fields every S3 client is built from."""
        return S3ConnectionFields(
            s3_endpoint=endpoint, s3_region=self.region, s3_access_key=self.access_key, s3_secret_key=self.secret_key
        )


def s3_client(endpoint: str, credentials: S3Credentials, timeout_s: float = S3Policy.ADMIN.read_timeout_s) -> S3Client:
    """The stack's admin client for ``endpoint``: `infra.clients.s3.make_s3_client` under the ADMIN policy, with
    both timeouts set to ``timeout_s`` (readiness probes ask for a short one)."""
    return make_s3_client(credentials.connection(endpoint), policy=S3Policy.ADMIN.with_timeout(timeout_s))


def _create_bucket(client: S3Client, name: str, object_lock: bool) -> None:
    from botocore.exceptions import ClientError

    try:
        client.create_bucket(Bucket=name, ObjectLockEnabledForBucket=object_lock)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise StackError(f"cannot create bucket {name}: {code or exc}") from exc


def _object_lock_enabled(client: S3Client, name: str) -> bool:
    from botocore.exceptions import ClientError

    try:
        config = client.get_object_lock_configuration(Bucket=name)
    except ClientError:
        return False
    return config.get("ObjectLockConfiguration", {}).get("ObjectLockEnabled") == "Enabled"


def ensure_buckets(
    endpoint: str,
    credentials: S3Credentials,
    audit_bucket: str = AUDIT_BUCKET,
    plain_buckets: Sequence[str] = (TANSU_BUCKET, LAKE_BUCKET),
) -> None:
    """Create the audit bucket (Object Lock) and the plain ones (Tansu's, the lake's) if missing; check the lock
    is on."""
    from botocore.exceptions import BotoCoreError

    try:
        client = s3_client(endpoint, credentials)
        _create_bucket(client, audit_bucket, object_lock=True)
        for name in plain_buckets:
            _create_bucket(client, name, object_lock=False)
        locked = _object_lock_enabled(client, audit_bucket)
    except BotoCoreError as exc:
        raise StackError(f"S3 at {endpoint} failed while creating buckets: {exc}") from exc
    if not locked:
        raise StackError(f"bucket {audit_bucket} exists without Object Lock; delete it or use a new run dir")


def ensure_table_bucket(endpoint: str, credentials: S3Credentials, name: str = ICEBERG_TABLE_BUCKET) -> None:
    """Create the S3 Tables *table bucket* that SeaweedFS's Iceberg REST catalog serves as warehouse
    ``s3://<name>/`` (the Iceberg audit lake's), if missing."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    client = boto3.client(
        "s3tables", endpoint_url=endpoint, region_name=credentials.region,
        aws_access_key_id=credentials.access_key, aws_secret_access_key=credentials.secret_key,
    )  # fmt: skip
    try:
        names = {b["name"] for b in client.list_table_buckets().get("tableBuckets", [])}
        if name not in names:
            client.create_table_bucket(name=name)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code not in ("BucketAlreadyExists", "ConflictException"):
            raise StackError(f"cannot create table bucket {name}: {code or exc}") from exc
    except BotoCoreError as exc:
        raise StackError(f"S3 at {endpoint} failed while creating table bucket {name}: {exc}") from exc
