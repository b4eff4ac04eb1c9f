"""Kafka client options from the connection fields, written once for every client (producer, consumer, admin).

`aiokafka_kwargs` is what each aiokafka client is built with: ``bootstrap_servers``, ``security_protocol``, the
SASL credentials under ``SASL_PLAINTEXT`` / ``SASL_SSL`` (mechanism PLAIN unless another is set), and under
``SSL`` / ``SASL_SSL`` an `ssl.SSLContext` (`ssl_context`): aiokafka refuses an SSL protocol without one, which
is how a client that set the protocol alone used to fail at start. The context verifies the brokers'
certificates against ``kafka_ssl_cafile`` (else the system's CAs), with hostname checking, and presents
``kafka_ssl_certfile`` / ``kafka_ssl_keyfile`` for mutual TLS when set.

`faststream_security` is the same translation for FastStream's broker (the replayer), with the same context.

`kafka_errors` are the exceptions a Kafka call can raise (aiokafka's and the socket's): each caller translates
them into its own package's error at its boundary. `start_client` starts a client or, when the broker refuses,
stops it again (aiokafka leaves its connections and tasks behind otherwise) and raises the caller's error;
`stop_quietly` stops one without raising (a close must not fail because the broker is gone).
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from infra.clients.connection import KafkaConnectionFields

if TYPE_CHECKING:
    from faststream.security import BaseSecurity


class _Client(Protocol):
    """What `start_client` needs of an aiokafka producer or consumer."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


_C = TypeVar("_C", bound=_Client)

SSL_PROTOCOLS = frozenset({"SSL", "SASL_SSL"})
SASL_PROTOCOLS = frozenset({"SASL_PLAINTEXT", "SASL_SSL"})


def kafka_errors() -> tuple[type[BaseException], ...]:
    """What a Kafka client call raises when the broker refuses or cannot be reached (imports aiokafka)."""
    from aiokafka.errors import KafkaError

    return (KafkaError, OSError)


async def start_client(client: _C, *, what: str, error: Callable[[str], Exception]) -> _C:
    """``await client.start()`` (an aiokafka producer or consumer), then the client; when the broker refuses,
    the client is stopped again and ``error("<what>: <the exception>")`` raised, the caller's package error."""
    try:
        await client.start()
    except kafka_errors() as exc:
        await stop_quietly(client)
        raise error(f"{what}: {exc!r}") from exc
    return client


async def stop_quietly(client: _Client) -> None:
    """``await client.stop()``, ignoring what Kafka raises (the broker may be gone: a close must not fail)."""
    with contextlib.suppress(*kafka_errors()):
        await client.stop()


def ssl_context(fields: KafkaConnectionFields) -> ssl.SSLContext:
    """A client context that verifies the brokers (``kafka_ssl_cafile`` or the system's CAs, hostname
    checked) and, with ``kafka_ssl_certfile``, presents a client certificate."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=fields.kafka_ssl_cafile)
    if fields.kafka_ssl_certfile is not None:
        context.load_cert_chain(fields.kafka_ssl_certfile, fields.kafka_ssl_keyfile)
    return context


def _sasl(fields: KafkaConnectionFields) -> tuple[str, str, str]:
    """(mechanism, username, password) under a SASL protocol."""
    password = fields.kafka_sasl_password.get_secret_value() if fields.kafka_sasl_password is not None else ""
    return (fields.kafka_sasl_mechanism or "PLAIN").upper(), fields.kafka_sasl_username or "", password


def aiokafka_kwargs(fields: KafkaConnectionFields) -> dict[str, Any]:
    """The keyword arguments that connect an aiokafka client (producer, consumer or admin) as the fields say;
    the caller adds its own (group, timeouts, ...). `ValueError` when ``kafka_bootstrap`` is unset."""
    if not fields.kafka_bootstrap:
        raise ValueError("kafka_bootstrap is not set")
    protocol = fields.kafka_security_protocol
    kwargs: dict[str, Any] = {"bootstrap_servers": fields.kafka_bootstrap, "security_protocol": protocol}
    if protocol in SSL_PROTOCOLS:
        kwargs["ssl_context"] = ssl_context(fields)
    if protocol in SASL_PROTOCOLS:
        mechanism, username, password = _sasl(fields)
        kwargs.update(sasl_mechanism=mechanism, sasl_plain_username=username, sasl_plain_password=password)
    return kwargs


def faststream_security(fields: KafkaConnectionFields) -> BaseSecurity | None:
    """FastStream's security object for the fields (PLAINTEXT: None), with the same SSL context."""
    from faststream.security import BaseSecurity, SASLPlaintext, SASLScram256, SASLScram512

    protocol = fields.kafka_security_protocol
    context = ssl_context(fields) if protocol in SSL_PROTOCOLS else None
    if protocol not in SASL_PROTOCOLS:
        return None if context is None else BaseSecurity(ssl_context=context)
    mechanism, username, password = _sasl(fields)
    use_ssl = context is not None
    if mechanism == "SCRAM-SHA-256":
        return SASLScram256(username, password, ssl_context=context, use_ssl=use_ssl)
    if mechanism == "SCRAM-SHA-512":
        return SASLScram512(username, password, ssl_context=context, use_ssl=use_ssl)
    return SASLPlaintext(username, password, ssl_context=context, use_ssl=use_ssl)
