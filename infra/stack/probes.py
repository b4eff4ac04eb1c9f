"""Readiness probes: "does this server answer a real request of its protocol", never "is the port open".

An open port only proves the listener exists; Tansu, SeaweedFS and vLLM all open theirs before they can
serve. Each probe here makes one cheap protocol-level request with a short timeout and returns a bool;
it never raises, because the caller polls it until a deadline.

* Kafka (Tansu): a Metadata v0 request over a plain socket, and the broker must advertise exactly the
  address we gave it. Written against the wire protocol (a dozen lines) rather than aiokafka, so the
  probe is synchronous and works from inside a running event loop (an async test restarting the broker).
* S3 (SeaweedFS): ``ListBuckets`` with the stack's credentials through boto3.
* vLLM: ``GET /v1/models`` answers 200.
"""

from __future__ import annotations

import socket
import struct

import httpx

from infra.stack.buckets import S3Credentials, s3_client

_METADATA_API_KEY = 3
_CLIENT_ID = b"reprolane-probe"


def _kafka_string(data: bytes, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from(">h", data, offset)
    start = offset + 2
    return data[start : start + length].decode("utf-8"), start + length


def _read_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        chunks.extend(chunk)
    return bytes(chunks)


def kafka_brokers(host: str, port: int, timeout_s: float = 1.0) -> list[tuple[str, int]]:
    """The ``(host, port)`` brokers listed in a Metadata v0 response from ``host:port``.

    Request: size, api_key=3, api_version=0, correlation_id, client_id, topics=[] (all topics).
    Response v0: size, correlation_id, brokers=[(node_id, host, port)], topics=[...] (not parsed).
    """
    correlation_id = 7
    body = struct.pack(">hhih", _METADATA_API_KEY, 0, correlation_id, len(_CLIENT_ID)) + _CLIENT_ID
    body += struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(struct.pack(">i", len(body)) + body)
        (size,) = struct.unpack(">i", _read_exact(sock, 4))
        data = _read_exact(sock, size)
    (got_id, count) = struct.unpack_from(">ii", data, 0)
    if got_id != correlation_id:
        raise ConnectionError(f"correlation id {got_id} != {correlation_id}")
    offset, brokers = 8, []
    for _ in range(count):
        offset += 4  # node_id
        broker_host, offset = _kafka_string(data, offset)
        (broker_port,) = struct.unpack_from(">i", data, offset)
        offset += 4
        brokers.append((broker_host, broker_port))
    return brokers


def kafka_ready(host: str, port: int) -> bool:
    """True when the broker answers Metadata and advertises ``host:port``."""
    try:
        return (host, port) in kafka_brokers(host, port)
    except (OSError, ConnectionError, struct.error, UnicodeDecodeError):
        return False


def s3_ready(endpoint: str, credentials: S3Credentials) -> bool:
    """True when ``ListBuckets`` succeeds against ``endpoint``."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client(endpoint, credentials, timeout_s=2.0).list_buckets()
    except (BotoCoreError, ClientError):
        return False
    return True


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``GET url`` answers 200."""
    try:
        return httpx.get(url, timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False
