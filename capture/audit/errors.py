"""Errors of the audit jobs.

    Exception
     └── AuditError                   base of everything raised by capture.audit
          ├── AuditStoreError         S3 refused or could not be reached (botocore translated at the boundary)
          ├── SigningKeyError         a signing / public key is missing or unreadable
          ├── InconsistentLogError    a log is not consistent with a checkpoint already signed: not signing it
          ├── UnknownIdError          no envelope, workflow or day of that name (the CLI exits 2)
          ├── IndexMismatchError      an index entry disagrees with the record it points at (never followed)
          ├── AccessDenied            an operator command refused: no key, wrong role, tenant out of scope (2)
          └── LakeError               the audit lake cannot be written, read, compacted or queried
               └── QueryError         the SQL itself was refused (capture.audit.lake.query)

The ledger the jobs read and append to (`capture.ledger`) raises its own tree (`capture.ledger.errors`:
`LedgerError`, `KeyringError`); the jobs' CLIs report both. A failed verification is not an exception: it is a
`verify.Finding` in a `verify.Verdict`.
"""

from __future__ import annotations

from typing import ClassVar

from schemas.errors import ReprolaneError


class AuditError(ReprolaneError):
    """Base of the audit jobs' errors."""


class AuditStoreError(AuditError):
    pass


class SigningKeyError(AuditError):
    """A key file missing or unreadable: the caller's to fix (exit 2)."""

    exit_code: ClassVar[int] = 2


class InconsistentLogError(AuditError):
    pass


class UnknownIdError(AuditError):
    """No envelope, workflow or day of that name (exit 2)."""

    exit_code: ClassVar[int] = 2


class LakeError(AuditError):
    pass


class IndexMismatchError(AuditError):
    pass


class AccessDenied(AuditError):
    """An operator command refused (`capture.audit.operators`); its refusal is in the access log."""

    exit_code: ClassVar[int] = 2
