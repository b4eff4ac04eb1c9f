"""The audit lake: envelopes and divergence events as tables an auditor queries.

- `capture.audit.lake.archiver`: the Kafka consumer that writes them (``reprolane serve archiver``);
- `capture.audit.lake.store` (Parquet partitions on S3) and `capture.audit.lake.iceberg` (an Iceberg REST
  catalog): the two lakes, one interface; `capture.audit.lake.schema`: their tables' columns;
- `capture.audit.lake.query`: SQL over the views with DuckDB (``reprolane audit query``);
- `capture.audit.lake.settings`, `capture.audit.lake.cli` (``serve archiver``, ``audit lake``, ``audit query``,
  ``keys tenant``).

Like all of `capture.audit` it imports schemas, `infra.clients`, the ledger and the rest of `capture.audit`,
never the sidecar (import-linter contracts in pyproject.toml).
"""
