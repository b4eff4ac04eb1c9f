"""The ledger: what the sidecar writes and the audit jobs read, in the audit and keys buckets.

- `merkle_log`: the append-only per-day leaf log of every stored envelope id (`MerkleLogWriter`, which the
  publisher drives through `capture.publishing.sinks.AuditLogSink`), and reading it back (`read_leaves`, `log_size`).
- `sealing`: per-tenant data keys wrapped by the KEK (`Keyring`, crypto-shredding) and the `Sealer` that seals
  an encrypted tenant's records before they leave the sidecar.
- `store`: the S3 boundary (`LedgerStore`: conditional creates, reads, listings).
- `records`: what the ledger reads of a stored record (`StoredRecord`, which `capture.publishing.outgoing.Outgoing`
  extends).
- `key_file`: hashed key files, one format for the sidecar's API keys and the operators' keys.
- `errors`: the ledger's small exception tree (`LedgerError`, `LedgerStoreError`, `KeyringError`, `KeyFileError`).

Imports: only `schemas` and `infra.clients` (S3). It imports nothing of the sidecar (``capture.*`` modules) or of
the audit jobs (`capture.audit`); both import it. The sidecar's records extend its record type (`records.StoredRecord`);
it reads its KEK through the shared data-key fields (`infra.clients.connection.DataKeyFields`).
"""
