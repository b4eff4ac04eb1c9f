"""Errors of the audit evidence.

    CaptureError                      (capture.errors)
     └── AuditError                   base of everything raised by capture.audit
          ├── AuditStoreError         S3 refused or could not be reached (botocore translated at the boundary)
          ├── SigningKeyError         a signing / public key is missing or unreadable
          └── UnknownIdError          no envelope, workflow or day of that name (the CLI exits 2)

A failed verification is not an exception: it is a `verify.Finding` in a `verify.Verdict`.
"""

from __future__ import annotations

from capture.errors import CaptureError


class AuditError(CaptureError):
    pass


class AuditStoreError(AuditError):
    pass


class SigningKeyError(AuditError):
    pass


class UnknownIdError(AuditError):
    pass
