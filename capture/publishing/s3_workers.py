"""S3 PUTs, run in threads of the sidecar process or in worker processes (``s3_processes``).

boto3 spends more CPU on one PUT (signing, request building, response parsing) than capturing a whole request
costs, and the S3 sink makes at least two per envelope (the object and its request-id index; the figures:
BENCHMARKS.md, "Sinks"). In the sidecar's own process, at a few hundred envelopes a second, the publisher would
take the CPU the HTTP edge needs. With
``s3_processes = N`` the PUTs run in N spawned worker processes, each with its own client and a few threads
(S3 calls mostly wait on the network); the sidecar sends each worker one task per batch (the `Put` specs:
keys, bodies, parameters), so its own cost per envelope is pickling a few KB.

Errors are translated where the PUT runs: a failed `Put` becomes a `PutFailure` (the record's spool seq, the
message, and whether S3 refused it for good), never a botocore exception (those do not always survive pickling).
S3 refuses a PUT for good with a 400 and one of `PERMANENT_CODES` (a key over 1,024 bytes, an object too large,
an invalid argument): the same request can never succeed, so the publisher quarantines that record; every other
failure (timeouts, 5xx, connection errors, throttling, access denied, a missing bucket) is transient and retried.
A worker that dies breaks the pool; `S3Processes` then starts a fresh one and reports the batch as failed, and
the publisher retries it, as for any failing sink.

An index put (``index_of`` set) is written once (``IfNoneMatch="*"``): when the key exists, the stored body is
read back; the same body is a redelivery of the same record (fine), another body means another record claimed
that request id or workflow step first: the first is kept and the put reports `PutOutcome.CONFLICT`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Final

from capture.errors import SinkError
from infra.clients.connection import S3ConnectionFields
from infra.clients.s3 import S3Policy, error_code, http_status, is_already_written, make_s3_client, s3_errors

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


#: S3 error codes that refuse a PUT for good (with a 400): retrying the same request cannot succeed.
PERMANENT_CODES: Final = frozenset(
    {"KeyTooLongError", "EntityTooLarge", "InvalidArgument", "MetadataTooLarge", "InvalidObjectName", "InvalidURI"}
)


class PutOutcome(Enum):
    WRITTEN = "written"
    EXISTED = "existed"  # a content address (or an index entry with the same body) already there
    CONFLICT = "conflict"  # an index entry another record wrote first: kept


@dataclass(frozen=True, slots=True)
class Put:
    """One ``put_object``: the key, the body and the other parameters, for the record with spool seq `seq`.
    ``created_is_enough``: the key is a content address written with ``IfNoneMatch="*"``, so "already there"
    (412) means the same bytes are there. ``index_of``: an index entry (written once; see module docstring)."""

    key: str
    body: bytes
    params: dict[str, Any] = field(default_factory=dict)
    created_is_enough: bool = False
    seq: int = -1
    index_of: bool = False


class PutRefusedError(SinkError):
    """S3 refused the PUT for good (`PERMANENT_CODES`)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PutFailure:
    """A PUT that did not store its object: `refused_code` is set when S3 refused it for good."""

    seq: int
    message: str
    refused_code: str | None = None


def is_refused_for_good(exc: BaseException) -> bool:
    """True when S3 answered a 400 with one of `PERMANENT_CODES`."""
    return error_code(exc) in PERMANENT_CODES and http_status(exc) in (400, None)


def run_put(client: S3Client, bucket: str, put: Put) -> PutOutcome:
    """Do one PUT; raises `SinkError` (`PutRefusedError` when refused for good; nothing else) when S3 did not
    store it."""
    try:
        client.put_object(Bucket=bucket, Key=put.key, Body=put.body, **put.params)
        return PutOutcome.WRITTEN
    except s3_errors() as exc:
        if is_already_written(exc):
            if put.created_is_enough:
                return PutOutcome.EXISTED
            if put.index_of:
                return _existing_index(client, bucket, put)
        code = error_code(exc)
        message = f"s3 put {bucket}/{put.key[:200]}: {f'{code}: ' if code else ''}{str(exc)[:300]}"
        if is_refused_for_good(exc):
            raise PutRefusedError(message, code) from exc
        raise SinkError(message) from exc


def _existing_index(client: S3Client, bucket: str, put: Put) -> PutOutcome:
    try:
        stored = client.get_object(Bucket=bucket, Key=put.key)["Body"].read()
    except s3_errors() as exc:
        raise SinkError(f"s3 get {bucket}/{put.key}: {error_code(exc) or exc}") from exc
    return PutOutcome.EXISTED if stored == put.body else PutOutcome.CONFLICT


def as_failure(put: Put, exc: SinkError) -> PutFailure:
    return PutFailure(put.seq, str(exc), exc.code if isinstance(exc, PutRefusedError) else None)


class S3Processes:
    """N spawned worker processes doing `Put`s (start in the constructor, `close` at shutdown)."""

    def __init__(self, settings: S3ConnectionFields, processes: int, *, threads: int = 8) -> None:
        if processes < 1:
            raise ValueError("processes must be >= 1")
        self.processes = processes
        self._settings = settings
        self._threads = threads
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        # spawn, not fork: the sidecar runs an event loop and threads, which a forked child must not inherit
        return ProcessPoolExecutor(
            max_workers=self.processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(self._settings, self._threads),
        )

    async def run(self, bucket: str, puts: Sequence[Put]) -> list[PutOutcome | PutFailure]:
        """Each PUT's outcome or failure, in the order of `puts`; `SinkError` when a worker process died."""
        if not puts:
            return []
        loop = asyncio.get_running_loop()
        chunks = [list(puts[i :: self.processes]) for i in range(min(self.processes, len(puts)))]
        try:  # a pool already known to be broken refuses at submit; one that breaks now fails the futures
            futures = [loop.run_in_executor(self._pool, _run_chunk, bucket, chunk) for chunk in chunks]
            results = await asyncio.gather(*futures, return_exceptions=True)
            broken = next((r for r in results if isinstance(r, BrokenProcessPool)), None)
        except BrokenProcessPool as exc:
            broken = exc
        if broken is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._start()
            raise SinkError(f"s3: a PUT worker process died ({broken}); started new ones") from broken
        outcomes: list[PutOutcome | PutFailure] = [PutFailure(p.seq, "s3: no answer from a worker") for p in puts]
        for i, result in enumerate(results):
            for j, put in enumerate(chunks[i]):
                if isinstance(result, BaseException):  # a bug in a worker, not an S3 answer: retried (transient)
                    outcomes[i + j * self.processes] = PutFailure(put.seq, f"{type(result).__name__}: {result}")
                else:
                    outcomes[i + j * self.processes] = result[j]
        return outcomes

    async def close(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------- in a worker

_client: S3Client | None = None
_executor: ThreadPoolExecutor | None = None


def _start_worker(settings: S3ConnectionFields, threads: int) -> None:
    global _client, _executor
    _client = make_s3_client(settings, policy=S3Policy.SIDECAR, threads=threads)
    _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="capture-s3")


def _run_chunk(bucket: str, puts: list[Put]) -> list[PutOutcome | PutFailure]:
    """The PUTs of one chunk, concurrently; each one's outcome or failure, in order."""
    client, executor = _client, _executor
    if client is None or executor is None:
        raise RuntimeError("S3 worker process not initialised")
    futures = [executor.submit(run_put, client, bucket, put) for put in puts]
    outcomes: list[PutOutcome | PutFailure] = []
    for put, future in zip(puts, futures, strict=True):
        try:
            outcomes.append(future.result())
        except SinkError as exc:
            outcomes.append(as_failure(put, exc))
    return outcomes
