"""The engine's schedule log (issue 22): recorded inside the production vLLM, shipped like envelopes.

- `shipper`: picks up the recorder's closed segments (``REPROLANE_SCHEDULE_DIR``), checks every line, and publishes
  each to S3 (written once, with the per-request index entries) and to Kafka, at least once; a segment is
  deleted only after both took it, and a bad one is quarantined, never retried forever (`reprolane capture
  schedules`).
- `shipper_settings`: its one settings object (env prefix ``REPROLANE_SHIPPER_``).
- `destinations`: the S3 and Kafka ends of a segment, their errors translated.
- `shipper_metrics`: its Prometheus metrics (``metrics_port``).

The recorder itself (`recorder`, loaded by vLLM as its scheduler class) is another module of this package; it runs
inside vLLM's engine process and shares nothing with the shipper but the on-disk contract
(`schemas.schedule_delivery`).
"""
