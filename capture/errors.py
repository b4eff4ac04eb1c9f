"""Errors of the capture sidecar.

    Exception
     └── CaptureError                 base of everything raised by this package
          ├── SpoolUnavailableError   the spool cannot take a record now (its write failed and was undone;
          │    │                      the next append tries again); guaranteed mode answers 503
          │    └── SpoolFullError     the spool reached its byte bound, or its disk has no space left
          ├── SpoolCorruptError       a spool segment could not be read back (names the file and offset)
          ├── SinkError               Kafka or S3 refused or could not be reached (translated at the boundary)
          ├── SealingError            a tenant's data key cannot be made or read to seal with (capture.ledger's
          │                           KeyringError, translated by the publisher)
          └── UpstreamError           the inference server could not be reached or answered garbage
               └── UpstreamTimeoutError   it did not answer (or stopped streaming) within the read timeout

The ledger (`capture.ledger`) and the audit jobs (`capture.audit`) have trees of their own.
Bad client input is not an exception here: it becomes an OpenAI-format 4xx and an error envelope.
"""

from __future__ import annotations


class CaptureError(Exception):
    """Base of the capture package's errors."""


class SpoolUnavailableError(CaptureError):
    pass


class SpoolFullError(SpoolUnavailableError):
    pass


class SpoolCorruptError(CaptureError):
    pass


class SinkError(CaptureError):
    pass


class UpstreamError(CaptureError):
    pass


class UpstreamTimeoutError(UpstreamError):
    pass


class SealingError(CaptureError):
    pass
