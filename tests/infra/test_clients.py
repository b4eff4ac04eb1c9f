"""infra.clients: the Kafka options for every security protocol, an SSL context for every client that asks for
SSL, the S3 policies each caller uses, and one reading of S3's errors for every caller.

The archiver connecting to a broker that requires TLS is in test_clients_stack.py (a real Tansu behind a TLS
listener); here its real consumer is built from its settings, which aiokafka refuses under SSL without a context.
Last, the stop event both consumers' processes wait on (`infra.clients.shutdown`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError
from botocore.exceptions import ClientError
from faststream.kafka.security import parse_security
from faststream.security import BaseSecurity, SASLPlaintext, SASLScram256, SASLScram512

from capture.audit.errors import AuditStoreError
from capture.audit.lake.archiver import Archiver
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.audit.store import AuditStore
from capture.errors import SinkError
from capture.ledger.errors import KeyringError, LedgerStoreError
from capture.ledger.sealing import Keyring
from capture.ledger.store import LedgerStore
from capture.publishing.kafka_sink import KafkaSink
from capture.publishing.s3_sink import S3Sink
from capture.publishing.s3_workers import Put, PutOutcome, run_put
from capture.settings import CaptureSettings
from infra.clients.connection import KafkaConnectionFields, S3ConnectionFields
from infra.clients.kafka import aiokafka_kwargs, faststream_security, start_client, stop_quietly
from infra.clients.s3 import S3Policy, is_already_written, is_missing, make_s3_client
from infra.clients.shutdown import stop_on_signals
from infra.stack.buckets import S3Credentials, s3_client
from replayer.errors import StoreError
from replayer.schedule.store import ScheduleStore
from replayer.service import ReplayerService
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from tests.infra.self_signed import self_signed
from tests.replayer.support import FakeLane, make_envelope
from tests.replayer.test_store import replay_result


def kafka(protocol: str, **fields: Any) -> KafkaConnectionFields:
    return KafkaConnectionFields(kafka_bootstrap="broker:9093", kafka_security_protocol=protocol, **fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------- Kafka options


def test_plaintext_has_neither_tls_nor_sasl() -> None:
    kwargs = aiokafka_kwargs(kafka("PLAINTEXT", kafka_sasl_mechanism="PLAIN", kafka_sasl_username="u"))
    assert kwargs == {"bootstrap_servers": "broker:9093", "security_protocol": "PLAINTEXT"}
    assert faststream_security(kafka("PLAINTEXT")) is None


def test_ssl_gets_a_verifying_context_and_no_sasl() -> None:
    kwargs = aiokafka_kwargs(kafka("SSL"))
    context = kwargs["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    assert "sasl_mechanism" not in kwargs
    security = faststream_security(kafka("SSL"))
    assert type(security) is BaseSecurity
    assert isinstance(security.ssl_context, ssl.SSLContext)
    assert parse_security(security)["security_protocol"] == "SSL"


def test_sasl_plaintext_defaults_to_plain_without_tls() -> None:
    fields = kafka("SASL_PLAINTEXT", kafka_sasl_username="capture", kafka_sasl_password="pw")
    kwargs = aiokafka_kwargs(fields)
    assert (kwargs["sasl_mechanism"], kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == (
        "PLAIN",
        "capture",
        "pw",
    )
    assert "ssl_context" not in kwargs
    security = faststream_security(fields)
    assert isinstance(security, SASLPlaintext)
    assert parse_security(security) | {"ssl_context": None} == {
        "security_protocol": "SASL_PLAINTEXT",
        "ssl_context": None,
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "capture",
        "sasl_plain_password": "pw",
    }


@pytest.mark.parametrize(
    ("mechanism", "expected", "kind"),
    [
        ("PLAIN", "PLAIN", SASLPlaintext),
        ("scram-sha-256", "SCRAM-SHA-256", SASLScram256),
        ("SCRAM-SHA-512", "SCRAM-SHA-512", SASLScram512),
    ],
)
def test_sasl_ssl_gets_the_mechanism_and_a_context(mechanism: str, expected: str, kind: type) -> None:
    fields = kafka("SASL_SSL", kafka_sasl_mechanism=mechanism, kafka_sasl_username="u", kafka_sasl_password="p")
    kwargs = aiokafka_kwargs(fields)
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == expected
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    security = faststream_security(fields)
    assert isinstance(security, kind)
    parsed = parse_security(security)
    assert (parsed["security_protocol"], parsed["sasl_mechanism"]) == ("SASL_SSL", expected)
    assert isinstance(parsed["ssl_context"], ssl.SSLContext)


def test_the_context_trusts_the_configured_ca_and_presents_the_client_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    context = aiokafka_kwargs(kafka("SSL", kafka_ssl_cafile=cert, kafka_ssl_certfile=cert, kafka_ssl_keyfile=key))[
        "ssl_context"
    ]
    assert [dict(ca["subject"][0])["commonName"] for ca in context.get_ca_certs()] == ["localhost"]
    with pytest.raises(ssl.SSLError):  # a key that does not belong to the certificate is refused when loading
        aiokafka_kwargs(kafka("SSL", kafka_ssl_certfile=cert, kafka_ssl_keyfile=self_signed(tmp_path, "other")[1]))


def test_no_bootstrap_is_refused() -> None:
    with pytest.raises(ValueError, match="kafka_bootstrap"):
        aiokafka_kwargs(KafkaConnectionFields())


# ------------------------------------------------------------------------------ every client that asks for SSL


async def test_every_kafka_client_that_asks_for_ssl_gets_a_context(tmp_path: Path) -> None:
    """The sidecar's producer, the archiver's consumer, an admin client (infra.stack.topics) and the replayer's broker,
    each built from its own settings with SSL: aiokafka refuses SSL without a context, so building is the check."""
    cert, _ = self_signed(tmp_path)
    ssl_fields: dict[str, Any] = {"kafka_security_protocol": "SSL", "kafka_ssl_cafile": cert}

    sidecar = CaptureSettings(upstream="http://127.0.0.1:9", kafka_bootstrap="localhost:9093", **ssl_fields)
    producer = AIOKafkaProducer(**KafkaSink(sidecar)._producer_kwargs())
    assert isinstance(producer.client._ssl_context, ssl.SSLContext)
    await producer.stop()

    lake = Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")
    consumer = Archiver(LakeSettings(kafka_bootstrap="localhost:9093", **ssl_fields), lake)._make_consumer()
    assert isinstance(consumer, AIOKafkaConsumer)
    assert consumer._client._security_protocol == "SSL"
    assert isinstance(consumer._client._ssl_context, ssl.SSLContext)
    assert consumer._client._ssl_context.get_ca_certs()  # the configured CA, not only the system's
    await consumer.stop()

    admin = AIOKafkaAdminClient(
        **aiokafka_kwargs(KafkaConnectionFields(kafka_bootstrap="localhost:9093", **ssl_fields))
    )
    assert isinstance(admin._client._ssl_context, ssl.SSLContext)
    await admin.close()

    replayer = ReplayerSettings(kafka_bootstrap="localhost:9093", metrics_port=None, **ssl_fields)
    service = ReplayerService(replayer, FakeLane(), store=None)  # type: ignore[arg-type]  # the broker only
    builder = service.broker.config.broker_config.builder
    assert builder.keywords["security_protocol"] == "SSL"
    assert isinstance(builder.keywords["ssl_context"], ssl.SSLContext)


class _Refused:
    """A Kafka client whose start the broker refuses; it records whether it was stopped again."""

    def __init__(self, stop_raises: bool = False) -> None:
        self.stopped = False
        self.stop_raises = stop_raises

    async def start(self) -> None:
        raise KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 9)]")

    async def stop(self) -> None:
        self.stopped = True
        if self.stop_raises:
            raise KafkaConnectionError("gone")


async def test_a_client_kafka_refuses_is_stopped_again_and_raises_the_callers_error() -> None:
    client = _Refused(stop_raises=True)  # a stop that fails too must not hide the start's error
    with pytest.raises(SinkError, match=r"^kafka x: cannot connect: KafkaConnectionError\("):
        await start_client(client, what="kafka x: cannot connect", error=SinkError)
    assert client.stopped
    await stop_quietly(_Refused(stop_raises=True))  # a close never raises what Kafka says


async def test_the_sidecars_producer_that_cannot_connect_is_a_sink_error() -> None:
    """A real aiokafka producer against a closed port: the sidecar's sink reports it as its own error."""
    sink = KafkaSink(CaptureSettings(upstream="http://127.0.0.1:9", kafka_bootstrap="127.0.0.1:9"))
    with pytest.raises(SinkError, match=r"^kafka 127\.0\.0\.1:9: cannot connect: "):
        await sink._ensure_started()
    assert sink._producer is None
    await sink.close()


# ------------------------------------------------------------------------------------------------- S3 policies


def _config(client: Any) -> tuple[float, float, int, int, str]:
    config = client.meta.config
    return (
        config.connect_timeout,
        config.read_timeout,
        config.retries["total_max_attempts"] - 1,  # botocore counts the first try too
        config.max_pool_connections,
        config.s3["addressing_style"],
    )


def test_each_caller_gets_its_named_s3_policy() -> None:
    common: dict[str, Any] = {"s3_endpoint": "http://127.0.0.1:9", "s3_access_key": "k", "s3_secret_key": "s"}
    sink_client: Any = S3Sink(CaptureSettings(upstream="http://127.0.0.1:9", **common), workers=32)._threads
    assert _config(sink_client[0]) == (3, 10, 2, 32, "path")
    store = EnvelopeStore.from_settings(ReplayerSettings(**common))
    assert _config(store._client) == (10, 30, 3, 10, "path")
    credentials = S3Credentials(access_key="k", secret_key="s")
    assert _config(s3_client("http://127.0.0.1:9", credentials)) == (10, 10, 2, 10, "path")
    assert _config(s3_client("http://127.0.0.1:9", credentials, timeout_s=2.0))[:3] == (2, 2, 2)
    assert _config(make_s3_client(S3ConnectionFields(**common), policy=S3Policy.AUDIT)) == (3, 10, 2, 10, "path")


def test_tls_verification_follows_the_setting() -> None:
    def verify_of(**fields: Any) -> Any:
        client: Any = make_s3_client(
            S3ConnectionFields(s3_endpoint="https://s3.invalid", **fields), policy=S3Policy.AUDIT
        )
        return client._endpoint.http_session._verify

    assert verify_of() is True
    assert verify_of(s3_verify_tls=False) is False


# -------------------------------------------------------------------------------- S3 errors, read once for all


def client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")  # type: ignore[typeddict-item]


MISSING = [("NoSuchKey", 404), ("NotFound", 404), ("404", 404)]
ALREADY_WRITTEN = [("PreconditionFailed", 412), ("412", 412), ("ConditionalRequestConflict", 409), ("", 412)]
NEITHER = [("AccessDenied", 403), ("NoSuchBucket", 404), ("InternalError", 500), ("SlowDown", 503)]


@pytest.mark.parametrize(("code", "status"), MISSING + ALREADY_WRITTEN + NEITHER)
def test_the_classification(code: str, status: int) -> None:
    exc = client_error(code, status)
    assert is_missing(exc) is ((code, status) in MISSING)
    assert is_already_written(exc) is ((code, status) in ALREADY_WRITTEN)
    assert not is_missing(ValueError())
    assert not is_already_written(ValueError())


class Refusing:
    """An S3 client every call of which S3 answers with one error."""

    def __init__(self, error: ClientError) -> None:
        self.error = error

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            raise self.error

        return call


def check_each(attempts: list[tuple[Callable[[], bool], type[Exception]]], classified: bool) -> None:
    """Every attempt answers True when S3's answer is of the class; else each raises its package's error."""
    for attempt, package_error in attempts:
        if classified:
            assert attempt()
        else:
            with pytest.raises(package_error):
                attempt()


@pytest.mark.parametrize(("code", "status"), ALREADY_WRITTEN + NEITHER)
def test_every_conditional_create_reads_already_written_alike(code: str, status: int) -> None:
    """The sidecar's content-addressed PUT, the ledger's and the audit jobs' `put_new`, the replayer's result write."""
    client: Any = Refusing(client_error(code, status))
    env = make_envelope(0)
    result = replay_result(env.envelope_id(), env.request_id)
    attempts: list[tuple[Callable[[], bool], type[Exception]]] = [
        (lambda: run_put(client, "b", Put("k", b"x", created_is_enough=True)) is PutOutcome.EXISTED, SinkError),
        (lambda: not LedgerStore(client, "b").put_new("k", b"x"), LedgerStoreError),
        (lambda: not AuditStore(client, "b").put_new("k", b"x"), AuditStoreError),
        (lambda: not EnvelopeStore(client, "b").put_result(env, result), StoreError),
    ]
    check_each(attempts, (code, status) in ALREADY_WRITTEN)


@pytest.mark.parametrize(("code", "status"), MISSING + NEITHER)
def test_every_read_reads_missing_alike(code: str, status: int) -> None:
    """The ledger's and the audit jobs' reads, the keyring's, the replayer's (envelopes and schedules)."""
    client: Any = Refusing(client_error(code, status))
    attempts: list[tuple[Callable[[], bool], type[Exception]]] = [
        (lambda: LedgerStore(client, "b").get("k") is None, LedgerStoreError),
        (lambda: AuditStore(client, "b").current_version("k") is None, AuditStoreError),
        (lambda: Keyring(client, "b", b"\0" * 32).get_key("acme", "k1") is None, KeyringError),
        (lambda: EnvelopeStore(client, "b")._get("k") is None, StoreError),
        (lambda: ScheduleStore(client, "b")._get("k", 16) is None, StoreError),
    ]
    check_each(attempts, (code, status) in MISSING)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_sigterm_or_sigint_sets_the_stop_event_instead_of_ending_the_process(sig: signal.Signals) -> None:
    loop = asyncio.get_running_loop()
    try:
        stop = stop_on_signals()
        assert not stop.is_set()
        os.kill(os.getpid(), sig)
        await asyncio.wait_for(stop.wait(), 10)
    finally:
        for each in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(each)


def test_installed_structured_outputs_names_the_backend_and_each_installed_grammar_library(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stack's runtime file and every lane write the same spelling, so a lane compares its own to production's."""
    from infra.clients import installed
    from tests.factories import fake_installed

    fake_installed(monkeypatch, {"xgrammar": "0.1.29", "llguidance": "1.3.0"})
    assert installed.installed_version("outlines_core") is None
    assert installed.installed_structured_outputs("auto") == "backend=auto;llguidance=1.3.0;xgrammar=0.1.29"
