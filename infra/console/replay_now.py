""" "Replay now": ask the running replayer service to replay one request, and wait for its answer.

The console asks; the replayer service acts. The ask is `replayer.on_demand` (what ``reprolane replay request
--via service`` does): the service of the console's replayer group (``REPROLANE_REPLAYER_GROUP_ID``) must be
running (its heartbeat is recent), the request (`schemas.replay.ReplayRequest`, with a fresh ``reply_to``) is
signed with the console's replay-request key (`schemas.replay_auth`, HMAC-SHA256, read from a keys file in the
replayer's own format, `replayer.request_keys`), and the answer, the service's divergence event on a lane it
advertises, names the result it stored in S3, which the request page then lists among its replays. Whatever
stops it (no key, no service running, a refusal with the service's reason, no answer in time) is said on the
page in words (`ReplayNowError`), never only in a tooltip.

The click waits for the answer (``REPROLANE_CONSOLE_REPLAY_TIMEOUT_S``): the service has its lane loaded, so a
short request answers in about a second, and an auditor who asked wants the verdict, not a promise.
"""

from __future__ import annotations

from pathlib import Path

from infra.errors import InfraError
from replayer.errors import ReplayerError
from replayer.on_demand import replay_via_service
from replayer.request_keys import load_replay_request_keys
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import Envelope
from schemas.replay_auth import REPLAY_ROLE

#: What the request page says when the console holds no replay-request key.
NO_KEY = (
    "this console holds no replay-request key: set REPROLANE_CONSOLE_REPLAY_KEYS_PATH and "
    "REPROLANE_CONSOLE_REPLAY_KEY_ID to a key that the replayer service accepts (its "
    "REPROLANE_REPLAYER_REPLAY_REQUEST_KEYS_PATH)"
)


class ReplayNowError(InfraError):
    """The replay was not done; the message says why, for the page."""


class ReplayPublisher:
    """Asks the replayer service of ``settings.group_id`` for on-demand replays, signed with one key."""

    def __init__(self, settings: ReplayerSettings, key_id: str, keys_path: Path, timeout_s: float = 60.0) -> None:
        self.settings = settings.model_copy(update={"replay_request_keys_path": keys_path,
                                                    "replay_request_key_id": key_id})  # fmt: skip
        self.key_id = key_id
        self.timeout_s = timeout_s

    @classmethod
    def from_files(cls, settings: ReplayerSettings, keys_path: Path, key_id: str,
                   timeout_s: float = 60.0) -> ReplayPublisher:  # fmt: skip
        """`InfraError` when the file cannot be trusted (see `replayer.request_keys`) or lacks a replay key."""
        try:
            keys = load_replay_request_keys(keys_path, field="REPROLANE_CONSOLE_REPLAY_KEYS_PATH")
        except ReplayerError as exc:
            raise InfraError(str(exc)) from exc
        key = keys.get(key_id)
        if key is None or REPLAY_ROLE not in key.roles:
            raise InfraError(f"REPROLANE_CONSOLE_REPLAY_KEY_ID: {key_id!r} is not a key with the replay role "
                             f"in {keys_path}")  # fmt: skip
        return cls(settings, key_id, keys_path, timeout_s)

    @property
    def group_id(self) -> str:
        return self.settings.group_id

    def replay(self, envelope: Envelope, store: EnvelopeStore) -> str:
        """Ask the service to replay `envelope` and wait for its answer (blocking: run it off the event loop);
        the answer in one line, or `ReplayNowError` saying why there is none."""
        try:
            result = replay_via_service(envelope, store, self.settings, "service", self.timeout_s, lambda _: None)
        except ReplayerError as exc:
            raise ReplayNowError(" ".join(str(exc).split())) from exc
        if result is None:  # "service" never falls back; kept for the type
            raise ReplayNowError("the replayer service gave no result")
        ev = result.event
        held = "met" if ev.target_met else "NOT met"
        return (f"replayed by the replayer service (group {self.group_id}): {ev.verdict} on lane {ev.lane}, "
                f"target {ev.target_level} {held}; the replay is listed below")  # fmt: skip
