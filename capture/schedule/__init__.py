"""The engine's schedule log (issue 22): recorded inside the production vLLM, shipped like envelopes.

Two sides that share nothing but the on-disk contract (`schemas.schedule_log`, `schemas.schedule_delivery`):

- inside vLLM's engine process, the recorder:
  - `recorder`: `RecordingScheduler`, vLLM's scheduler with a recorder on the side, loaded by vLLM itself through
    ``--scheduler-cls capture.schedule.recorder.RecordingScheduler``. It is the one module of ``capture`` that
    imports vLLM (at module level: it subclasses vLLM's scheduler, and only vLLM ever imports it).
  - `segments`: the segment writer: records queued by the engine step, encoded, written, fsynced and renamed on a
    background thread; IO errors are counted and logged, never raised.
  These two import only `schemas` (an import-linter contract), so vLLM's process loads nothing of the sidecar.
- beside vLLM, the shipper (`reprolane serve schedules`):
  - `shipper`: picks up the recorder's closed segments (``REPROLANE_SCHEDULE_DIR``), checks every line, and
    publishes each to S3 (written once, with the per-request index entries) and to Kafka, at least once; a segment
    is deleted only after both took it, and a bad one is quarantined, never retried forever.
  - `shipper_settings`: its one settings object (env prefix ``REPROLANE_SHIPPER_``).
  - `destinations`: the S3 and Kafka ends of a segment, their errors translated.
  - `shipper_metrics`: its Prometheus metrics (``metrics_port``).
"""
