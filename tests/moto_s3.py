"""moto's S3 server for fast tests, in a child process.

Never in-process: moto's server is a Flask app, and once Flask is imported its context-local proxies
(``flask.g``, ``request``) sit in ``sys.modules``; vLLM's in-process engine start walks every module's
attributes (``vllm.triton_utils.dispatcher._rebind_kernels``) and touching a proxy outside an app context raises
``RuntimeError: Working outside of application context``. A test session that used an in-process moto before
a vLLM lane test therefore failed to start the lane.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from capture.settings import CaptureSettings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_server(timeout_s: float = 30.0) -> Iterator[str]:
    """Start ``moto_server`` on 127.0.0.1 and yield its endpoint URL; stop its process group afterwards."""
    port = _free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                httpx.get(endpoint, timeout=1.0)
                break
            except httpx.HTTPError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def moto_client(endpoint: str) -> Any:
    """A boto3 S3 client for the moto server at `endpoint` (moto takes any credentials; these are the tests')."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s"
    )


def capture_settings(endpoint: str, bucket: str, spool_dir: Path, **fields: Any) -> CaptureSettings:
    """The sidecar's settings for a publisher whose S3 sink writes to `bucket` on the moto server at `endpoint`
    (with `moto_client`'s credentials), spooling to `spool_dir`; no upstream is ever called. `fields` add to them."""
    from capture.settings import CaptureSettings

    return CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=spool_dir,
        s3_endpoint=endpoint,
        s3_access_key="k",
        s3_secret_key="s",
        s3_bucket=bucket,
        **fields,
    )
