"""Errors of the capture sidecar.

    Exception
     └── CaptureError                 base of everything raised by this package
          ├── SpoolUnavailableError   the spool cannot take a record now (its write failed and was undone;
          │    │                      the next append tries again); guaranteed mode answers 503
          │    └── SpoolFullError     the spool reached its byte bound, or its disk has no space left
          ├── SpoolCorruptError       a spool segment could not be read back (names the file and offset)
          ├── SinkError               Kafka or S3 refused or could not be reached (translated at the boundary)
          │    └── RecordsRefused     the sink confirmed the batch except these records, which it refuses for
          │                           good (too large, key too long, invalid): the publisher quarantines them
          ├── SealingError            a tenant's data key cannot be made or read to seal with (capture.ledger's
          │                           KeyringError, translated by the publisher)
          └── UpstreamError           the inference server could not be reached or answered garbage
               └── UpstreamTimeoutError   it did not answer (or stopped streaming) within the read timeout

The ledger (`capture.ledger`) and the audit jobs (`capture.audit`) have trees of their own.
Bad client input is not an exception here: it becomes an OpenAI-format 4xx and an error envelope.
"""

from __future__ import annotations

from schemas.errors import ReprolaneError


class CaptureError(ReprolaneError):
    """Base of the capture package's errors."""


class SpoolUnavailableError(CaptureError):
    pass


class SpoolFullError(SpoolUnavailableError):
    pass


class SpoolCorruptError(CaptureError):
    pass


class SinkError(CaptureError):
    pass


class RecordsRefused(SinkError):
    """Every record of the batch is confirmed except `refused` (spool seq -> ``(code, reason)``), which the sink
    will never take: retrying them cannot succeed, so the publisher quarantines them and moves on."""

    def __init__(self, sink: str, refused: dict[int, tuple[str, str]]) -> None:
        first = next(iter(refused.values()), ("", ""))
        super().__init__(f"{sink}: refused {len(refused)} record(s) for good; first: {first[1]}")
        self.sink = sink
        self.refused = refused


class UpstreamError(CaptureError):
    pass


class UpstreamTimeoutError(UpstreamError):
    pass


class SealingError(CaptureError):
    pass
