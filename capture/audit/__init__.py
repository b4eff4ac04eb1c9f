"""The audit evidence the capture side keeps: a Merkle log of every stored envelope, signed checkpoints,
verification, retention and legal hold.

- `merkle_log`: the append-only per-day leaf log the publisher writes after every stored batch.
- `checkpoint`: the job that signs the log's root (`reprolane audit checkpoint`), and `reconcile`.
- `verify`: inclusion and consistency proofs, and the tamper findings (`reprolane verify`).
- `retention`: legal holds and the expiry job (`reprolane hold`, `reprolane expire`).
- `store`: the S3 boundary (every botocore error becomes `AuditStoreError`); `keys`: Ed25519 key files.
- `datakeys`: per-tenant data keys (wrapped by the KEK) for sealed envelopes; `Sealer`; crypto-shredding.
- `lake_schema`, `archiver`, `lake`, `query`, `lake_settings`, `lake_cli`: the audit lake (Parquet on S3,
  DuckDB queries, compaction, request-id index rebuild) and ``reprolane lake|query|keys``.
- `settings`: `AuditSettings` (``REPROLANE_AUDIT_*``); `cli`: the typer apps; `errors`: the exception tree.
"""
