"""Errors of the replayer.

    Exception
     └── ReplayerError                base of everything raised by this package
          ├── LaneUnavailableError    a lane cannot start here (names the reason: platform, backend, missing extra)
          ├── NotReplayableError      the envelope has no prompt ids / contract / complete output, or its data
          │    │                      was shredded; the message says which
          │    └── ScheduleNotFoundError  the envelope names no engine schedule, or none is indexed (yet)
          ├── EnvelopeNotFoundError   no envelope is indexed under that request id / workflow id
          ├── StoreError              S3 or Kafka refused or could not be reached (translated at the boundary)
          ├── GateInputError          a release gate cannot reach a verdict: bad golden set, selector, fingerprint
          └── ServiceReplayError      an on-demand replay through the running service failed: none is running,
                                      it refused the request (the dead-letter reason), or no answer in time

A divergence is a result (`schemas.DivergenceEvent`), never an exception.
"""

from __future__ import annotations

from typing import ClassVar

from schemas.errors import ReprolaneError


class ReplayerError(ReprolaneError):
    """Base of the replayer package's errors: every one means "no verdict", exit 2 (`infra.cli`)."""

    exit_code: ClassVar[int] = 2


class LaneUnavailableError(ReplayerError):
    pass


class NotReplayableError(ReplayerError):
    pass


class ScheduleNotFoundError(NotReplayableError):
    """No engine schedule for this envelope (`replayer.schedule.store`): a replay falls back to another lane."""


class EnvelopeNotFoundError(ReplayerError):
    pass


class StoreError(ReplayerError):
    pass


class GateInputError(ReplayerError):
    pass


class ServiceReplayError(ReplayerError):
    pass
