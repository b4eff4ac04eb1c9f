"""S3 PUTs, run in threads of the sidecar process or in worker processes (``s3_processes``).

boto3 spends ~1.1-1.3 ms of CPU on one PUT here (signing, request building, response parsing), and the S3 sink
makes two per envelope (the object and its request-id index; see "Publishing" in BENCHMARKS.md). In the
sidecar's own process that is ~2.5 ms per envelope, five times what capturing the request costs: at a few
hundred envelopes a second the publisher would take the CPU the HTTP edge needs. With
``s3_processes = N`` the PUTs run in N spawned worker processes, each with its own client and a few threads
(S3 calls mostly wait on the network); the sidecar sends each worker one task per batch (the `Put` specs:
keys, bodies, parameters), so its own cost per envelope is pickling a few KB.

Errors are translated where the PUT runs: a failed `Put` becomes a `SinkError` message, never a botocore
exception (those do not always survive pickling). A worker that dies breaks the pool; `S3Processes` then starts
a fresh one and reports the batch as failed, and the publisher retries it, as for any failing sink.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from capture.errors import SinkError
from infra.clients.connection import S3ConnectionFields
from infra.clients.s3 import S3Policy, error_code, is_already_written, make_s3_client, s3_errors

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


@dataclass(frozen=True, slots=True)
class Put:
    """One ``put_object``: the key, the body and the other parameters. ``created_is_enough``: the key is a
    content address written with ``IfNoneMatch="*"``, so "already there" (412) means the same bytes are there."""

    key: str
    body: bytes
    params: dict[str, Any] = field(default_factory=dict)
    created_is_enough: bool = False


def run_put(client: S3Client, bucket: str, put: Put) -> None:
    """Do one PUT; raises `SinkError` (and nothing else) when S3 did not store it."""
    try:
        client.put_object(Bucket=bucket, Key=put.key, Body=put.body, **put.params)
    except s3_errors() as exc:
        if put.created_is_enough and is_already_written(exc):
            return
        code = error_code(exc)
        raise SinkError(f"s3 put {bucket}/{put.key}: {f'{code}: ' if code else ''}{exc}") from exc


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

    async def run(self, bucket: str, puts: Sequence[Put]) -> None:
        """Every PUT done, or `SinkError` naming how many failed and the first failure."""
        if not puts:
            return
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
        errors: list[str] = []
        for result in results:
            if isinstance(result, BaseException):  # a bug in a worker, not an S3 answer: still only a SinkError here
                errors.append(f"{type(result).__name__}: {result}")
            else:
                errors.extend(result)
        if errors:
            raise SinkError(f"s3: {len(errors)} of {len(puts)} puts failed; first: {errors[0]}")

    async def close(self) -> None:
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)


# ---------------------------------------------------------------------------------------------- in a worker

_client: S3Client | None = None
_executor: ThreadPoolExecutor | None = None


def _start_worker(settings: S3ConnectionFields, threads: int) -> None:
    global _client, _executor
    _client = make_s3_client(settings, policy=S3Policy.SIDECAR, threads=threads)
    _executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="capture-s3")


def _run_chunk(bucket: str, puts: list[Put]) -> list[str]:
    """The PUTs of one chunk, concurrently; the messages of those that failed."""
    client, executor = _client, _executor
    if client is None or executor is None:
        raise RuntimeError("S3 worker process not initialised")
    futures = [executor.submit(run_put, client, bucket, put) for put in puts]
    errors: list[str] = []
    for future in futures:
        try:
            future.result()
        except SinkError as exc:
            errors.append(str(exc))
    return errors
