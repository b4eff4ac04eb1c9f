""" "Replay now": a signed on-demand replay request on the replayer's request topic.

The console asks; the replayer service acts. The request (`schemas.replay.ReplayRequest`: the request id, a
``reply_to`` correlation id the divergence event echoes) is signed with the console's replay-request key
(`schemas.replay_auth.sign_replay_request`, HMAC-SHA256, stamped now), read from a keys file in the replayer's
own format (`replayer.request_keys`), and sent keyed by request id, as the topic's contract says
(`schemas.layout`). A replayer with the same key in its keys file acts on it within its window; any other
request is dead-lettered there as unauthorised. Without a configured key the console offers no "replay now".
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from infra.clients.kafka import aiokafka_kwargs, kafka_errors
from infra.errors import InfraError
from replayer.request_keys import load_replay_request_keys
from replayer.settings import ReplayerSettings
from schemas.replay import ReplayRequest
from schemas.replay_auth import REPLAY_ROLE, ReplayRequestKey, sign_replay_request

SEND_TIMEOUT_S = 15.0


class ReplayPublisher:
    """Signs and sends on-demand replay requests (one producer per request: a click, not a stream)."""

    def __init__(self, settings: ReplayerSettings, key_id: str, key: ReplayRequestKey) -> None:
        self.settings = settings
        self.key_id = key_id
        self._key = key

    @classmethod
    def from_files(cls, settings: ReplayerSettings, keys_path: Path, key_id: str) -> ReplayPublisher:
        """`InfraError` when the file cannot be trusted (see `replayer.request_keys`) or lacks a replay key."""
        keys = load_replay_request_keys(keys_path, field="REPROLANE_CONSOLE_REPLAY_KEYS_PATH")
        key = keys.get(key_id)
        if key is None or REPLAY_ROLE not in key.roles:
            raise InfraError(f"REPROLANE_CONSOLE_REPLAY_KEY_ID: {key_id!r} is not a key with the replay role "
                             f"in {keys_path}")  # fmt: skip
        return cls(settings, key_id, key)

    async def request(self, request_id: str) -> ReplayRequest:
        """Send one signed request for `request_id`; `InfraError` when Kafka does not take it."""
        from aiokafka import AIOKafkaProducer

        signed = sign_replay_request(
            ReplayRequest(request_id=request_id, reply_to=f"console-{uuid.uuid4().hex}"), self.key_id, self._key.secret
        )
        failures: tuple[type[BaseException], ...] = (TimeoutError, *kafka_errors())
        producer = AIOKafkaProducer(**aiokafka_kwargs(self.settings), request_timeout_ms=int(SEND_TIMEOUT_S * 1000))
        try:
            await asyncio.wait_for(producer.start(), SEND_TIMEOUT_S)
            await asyncio.wait_for(
                producer.send_and_wait(
                    self.settings.replay_request_topic, signed.model_dump_json().encode("utf-8"),
                    key=request_id.encode("utf-8"),
                ),
                SEND_TIMEOUT_S,
            )  # fmt: skip
        except failures as exc:
            raise InfraError(f"the replay request for {request_id} was not sent: {type(exc).__name__}: {exc}") from exc
        finally:
            await producer.stop()
        return signed
