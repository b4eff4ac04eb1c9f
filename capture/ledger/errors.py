"""Errors of the ledger.

    Exception
     └── LedgerError              base of everything raised by capture.ledger (e.g. a lost Merkle-log append race)
          ├── LedgerStoreError    S3 refused or could not be reached (botocore translated at the boundary)
          ├── KeyringError        a tenant data key cannot be made, read, unwrapped or shredded
          └── KeyFileError        a hashed key file (API or operator keys) is unreadable, open to others or malformed

Each user translates these at its own boundary: the sidecar into `capture.errors` (`SinkError`,
`SealingError`); the audit jobs' store (`capture.audit.store.AuditStore`) raises
`capture.audit.errors.AuditStoreError` where a `LedgerStore` raises `LedgerStoreError`.
"""

from __future__ import annotations

from schemas.errors import ReprolaneError


class LedgerError(ReprolaneError):
    """Base of the ledger's errors."""


class LedgerStoreError(LedgerError):
    pass


class KeyringError(LedgerError):
    pass


class KeyFileError(LedgerError):
    pass
