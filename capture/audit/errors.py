"""Errors of the audit jobs.

    Exception
     └── AuditError                   base of everything raised by capture.audit
          ├── AuditStoreError         S3 refused or could not be reached (botocore translated at the boundary)
          ├── SigningKeyError         a signing / public key is missing or unreadable
          ├── InconsistentLogError    a log is not consistent with a checkpoint already signed: not signing it
          ├── UnknownIdError          no envelope, workflow or day of that name (the CLI exits 2)
          └── LakeError               the audit lake cannot be written, read, compacted or queried
               └── QueryError         the SQL itself was refused (capture.audit.query)

The ledger the jobs read and append to (`capture.ledger`) raises its own tree (`capture.ledger.errors`:
`LedgerError`, `KeyringError`); the jobs' CLIs report both. A failed verification is not an exception: it is a
`verify.Finding` in a `verify.Verdict`.
"""

from __future__ import annotations


class AuditError(Exception):
    """Base of the audit jobs' errors."""


class AuditStoreError(AuditError):
    pass


class SigningKeyError(AuditError):
    pass


class InconsistentLogError(AuditError):
    pass


class UnknownIdError(AuditError):
    pass


class LakeError(AuditError):
    pass
