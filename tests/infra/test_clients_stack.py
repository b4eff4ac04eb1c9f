"""The archiver (and the sidecar's producer) connect to a Kafka that requires TLS.

Tansu 0.6 has no usable TLS listener (its ``--cert`` and ``--key`` flags exclude each other), so the broker that
requires TLS is a private Tansu (in memory) behind a TLS terminator: Tansu advertises the terminator's port, so
every connection a client makes (bootstrap, group coordinator, fetches) goes through TLS with a self-signed
certificate, and a plaintext client cannot even bootstrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from capture.audit.errors import LakeError
from capture.audit.lake.archiver import Archiver
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.outgoing import Outgoing
from capture.settings import CaptureSettings
from capture.spool import SpoolEntry
from infra.clients.kafka import aiokafka_kwargs
from tests.factories import envelope
from tests.infra.self_signed import self_signed
from tests.private_tansu import private_tansu

pytestmark = [pytest.mark.stack, pytest.mark.beside_engines]


@pytest.fixture
def tansu(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """(inner plaintext port, advertised TLS port) of a private in-memory Tansu (`tests.private_tansu`)."""
    with private_tansu(tmp_path / "tansu.log", advertised_host="localhost") as ports:
        yield ports


@pytest.fixture
async def tls_kafka(tansu: tuple[int, int], tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """(bootstrap, CA file) of the broker that requires TLS."""
    inner, outer = tansu
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def terminate(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            broker_reader, broker_writer = await asyncio.open_connection("127.0.0.1", inner)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, broker_writer), pipe(broker_reader, client_writer))

    server = await asyncio.start_server(terminate, "127.0.0.1", outer, ssl=context)
    try:
        yield f"localhost:{outer}", cert
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 5)


async def test_the_archiver_consumes_from_a_kafka_that_requires_tls(
    tls_kafka: tuple[str, Path], tmp_path: Path
) -> None:
    bootstrap, ca = tls_kafka
    topic, divergences = f"tls-envelopes-{uuid.uuid4().hex[:8]}", f"tls-divergences-{uuid.uuid4().hex[:8]}"
    settings = LakeSettings(
        kafka_bootstrap=bootstrap,
        kafka_security_protocol="SSL",
        kafka_ssl_cafile=ca,
        envelope_topic=topic,
        divergence_topic=divergences,
        group_id=f"tls-{uuid.uuid4().hex[:8]}",
        flush_rows=1,
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    admin = AIOKafkaAdminClient(**aiokafka_kwargs(settings))
    await admin.start()
    try:
        await admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1) for t in (topic, divergences)])
    finally:
        await admin.close()

    # the sidecar's producer, over the same TLS
    sidecar = CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=tmp_path / "spool",
        kafka_bootstrap=bootstrap,
        kafka_security_protocol="SSL",
        kafka_ssl_cafile=ca,
    )
    env = envelope(request_id=f"req-tls-{uuid.uuid4().hex[:8]}")
    sink = KafkaSink(sidecar, topic=topic)
    try:
        await sink.publish([Outgoing.from_entry(SpoolEntry(1, env.canonical()))])
    finally:
        await sink.close()

    archiver = Archiver(settings, Lake(pafs.LocalFileSystem(), str(tmp_path / "lake"), "lake"))
    stop = asyncio.Event()
    run = asyncio.create_task(archiver.run(stop, poll_ms=200))
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while archiver.stats.rows_written < 1:
            assert not run.done(), run.exception()
            assert asyncio.get_running_loop().time() < deadline, archiver.stats
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(run, 30)
    assert (archiver.stats.consumed, archiver.stats.skipped) == (1, 0)
    assert archiver.stats.files_written == 1

    # and the broker does require TLS: the same consumer in plaintext cannot even bootstrap
    plaintext = Archiver(settings.model_copy(update={"kafka_security_protocol": "PLAINTEXT"}), archiver.lake)
    with pytest.raises(LakeError, match="cannot consume"):
        await asyncio.wait_for(plaintext.run(asyncio.Event()), 60)
