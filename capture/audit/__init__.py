"""The audit-evidence jobs: checkpoints, verification, retention and legal hold, and the audit lake.

They read (and, for reconcile and checkpoints, append to) the ledger the sidecar writes (`capture.ledger`), and
run anywhere with access to the buckets, not on the request path.

- `checkpoint`: the job that signs the Merkle log's root (`reprolane audit checkpoint`), and `reconcile`.
- `verify`: inclusion and consistency proofs, and the tamper findings (`reprolane audit verify`).
- `retention`: legal holds and the expiry job (`reprolane audit hold`, `reprolane audit expire`).
- `store`: `AuditStore`, the ledger's store plus the jobs' calls (every botocore error becomes `AuditStoreError`).
- `signing_keys`: the Ed25519 key files checkpoints are signed and verified with.
- `lake_schema`, `archiver`, `lake`, `query`, `lake_settings`, `lake_cli`: the audit lake (Parquet on S3,
  DuckDB queries, compaction, request-id index rebuild) and ``reprolane audit lake|query|keys``.
- `settings`: `AuditSettings` (``REPROLANE_AUDIT_*``); `cli`: the typer apps; `errors`: the exception tree.

Imports: `schemas`, `infra.clients` and `capture.ledger` only; never a module of the sidecar (`capture.errors`,
`capture.settings`, `capture.publishing.sinks`, `capture.spool`, ...), and the sidecar never imports this package.
"""
