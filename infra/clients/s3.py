"""The S3 client every service builds, and the one reading of botocore's errors.

`make_s3_client` builds a boto3 client from the connection fields (`infra.clients.connection.S3ConnectionFields`, which
every service's settings inherit): path-style addressing (SeaweedFS, MinIO and AWS all take
it), TLS verified unless ``s3_verify_tls`` is off, and the timeouts and retries of a named `S3Policy`, one per
use, because the uses want different things:

    SIDECAR   3 s connect, 10 s read, 2 retries   the publisher retries a failed batch itself, with backoff;
              a long boto3 retry would only hold the batch (and the spool's lag) longer. Pool >= workers.
    AUDIT     3 s connect, 10 s read, 2 retries   the audit jobs, the lake's index rebuild and the keys commands:
              an operator waits on them, and they are rerun by hand.
    REPLAYER  10 s connect, 30 s read, 3 retries  a consumer that must not dead-letter a message for a blip.
    ADMIN     10 s connect and read, 2 retries    the local stack creating buckets and probing readiness
              (`S3Policy.with_timeout` for a shorter probe).

(A retry count is botocore's ``retries={"max_attempts": n}``: n tries after the first, in its standard mode.)

Errors: the codes S3 servers answer for "no such key" and for a conditional create (``If-None-Match: *``) that
found the key already written differ between AWS, SeaweedFS and moto, so they are read here once:
`is_missing` (``NoSuchKey``, ``NotFound``, and ``404`` from HEAD, which has no body) and `is_already_written`
(``PreconditionFailed`` / HTTP 412, and ``ConditionalRequestConflict``: a concurrent conditional write of the
same key, which for the content-addressed and write-once keys we create means the same object is being
written by someone else). Every caller still translates what is neither into its own package's error:
`s3_call` does that in one place (None for the answers a caller expects, its own error for the rest).

boto3 and botocore are imported inside the functions: a CLI's ``--help`` does not pay for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, TypeVar

from infra.clients.connection import S3ConnectionFields

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_T = TypeVar("_T")

MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
ALREADY_WRITTEN_CODES = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict"})


@dataclass(frozen=True)
class S3Policy:
    """How long one S3 call may wait and how often boto3 retries it (module docstring: one per use)."""

    connect_timeout_s: float
    read_timeout_s: float
    max_retries: int

    SIDECAR: ClassVar[S3Policy]
    AUDIT: ClassVar[S3Policy]
    REPLAYER: ClassVar[S3Policy]
    ADMIN: ClassVar[S3Policy]

    def with_timeout(self, timeout_s: float) -> S3Policy:
        """The same policy with both timeouts set to `timeout_s`."""
        return replace(self, connect_timeout_s=timeout_s, read_timeout_s=timeout_s)


S3Policy.SIDECAR = S3Policy(connect_timeout_s=3.0, read_timeout_s=10.0, max_retries=2)
S3Policy.AUDIT = S3Policy(connect_timeout_s=3.0, read_timeout_s=10.0, max_retries=2)
S3Policy.REPLAYER = S3Policy(connect_timeout_s=10.0, read_timeout_s=30.0, max_retries=3)
S3Policy.ADMIN = S3Policy(connect_timeout_s=10.0, read_timeout_s=10.0, max_retries=2)

#: boto3's own default connection pool size; a client used from more threads gets one connection per thread.
MIN_POOL_CONNECTIONS = 10


def make_s3_client(fields: S3ConnectionFields, *, policy: S3Policy, threads: int = 1) -> S3Client:
    """A boto3 S3 client for the fields under `policy`; `threads`: how many threads share it (its pool)."""
    import boto3
    from botocore.config import Config

    secret = fields.s3_secret_key.get_secret_value() if fields.s3_secret_key is not None else None
    return boto3.client(
        "s3",
        endpoint_url=fields.s3_endpoint,
        region_name=fields.s3_region,
        aws_access_key_id=fields.s3_access_key,
        aws_secret_access_key=secret,
        verify=fields.s3_verify_tls,
        config=Config(
            connect_timeout=policy.connect_timeout_s,
            read_timeout=policy.read_timeout_s,
            retries={"max_attempts": policy.max_retries, "mode": "standard"},
            max_pool_connections=max(MIN_POOL_CONNECTIONS, threads),
            s3={"addressing_style": "path"},
        ),
    )


def s3_errors() -> tuple[type[Exception], ...]:
    """What a boto3 call raises when S3 refuses or cannot be reached: ``except s3_errors() as exc``."""
    from botocore.exceptions import BotoCoreError, ClientError

    return (ClientError, BotoCoreError)


def error_code(exc: BaseException) -> str:
    """The S3 error code of a botocore `ClientError` (``NoSuchKey``, ``412``, ...); "" for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a botocore `ClientError`; None for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def is_missing(exc: BaseException) -> bool:
    """True when S3 answered that the key does not exist (a GET or HEAD of nothing)."""
    return error_code(exc) in MISSING_CODES


def is_already_written(exc: BaseException) -> bool:
    """True when a conditional create (``If-None-Match: *``) found the key already written (module docstring)."""
    return error_code(exc) in ALREADY_WRITTEN_CODES or http_status(exc) == 412


def s3_call(
    what: str,
    where: str,
    call: Callable[[], _T],
    *,
    none_if: Callable[[BaseException], bool],
    error: Callable[[str], Exception],
) -> _T | None:
    """`call()`, or None when S3's answer is one `none_if` accepts (`is_missing`, `is_already_written`); any other
    S3 failure is raised as ``error("S3 <what> <where> failed: <code>")``, the caller's own package error."""
    try:
        return call()
    except s3_errors() as exc:
        if none_if(exc):
            return None
        raise error(f"S3 {what} {where} failed: {error_code(exc) or exc}") from exc
