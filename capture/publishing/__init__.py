"""The publishing path: the spool drained to Kafka and S3 (Object Lock), at least once.

    spool (`capture.spool`) -> `publisher` -> sealing (encrypted tenants) -> `sinks`: `kafka_sink`, `s3_sink`
        (S3 PUTs optionally in worker processes: `s3_workers`), then the Merkle log's ``audit-log`` sink
        -> acked in the spool; a record a sink refuses for good -> `quarantine`

- `publisher`: drains the spool in batches, seals an encrypted tenant's records first, publishes each batch to
  every sink, retries what failed, acks what all took, quarantines what a sink refused for good.
- `outgoing`: `Outgoing`, the record the sinks take (a spool entry, its envelope's id and keys, sealed or not).
- `sinks`: the `Sink` protocol, the Merkle log as a sink (`AuditLogSink`) and the configured set
  (`default_sinks`); `kafka_sink`: `KafkaSink`, the envelopes topic, claim checks and the dead-letter topic;
  `s3_sink`: `S3Sink`, envelope objects under Object Lock and the write-once index objects.
- `s3_workers`: S3 PUTs in threads or in worker processes, their errors translated where they run (the schedule
  shipper, `capture.schedule.destinations`, runs its PUTs through it too).
- `quarantine`: the records a sink refuses for good, kept on disk beside the spool and counted.

May import `capture.settings`, `capture.errors`, `capture.metrics`, `capture.spool`, `capture.ledger`, `schemas`
and `infra.clients`. It reads envelopes back from the spool as canonical bytes and never imports the request
path (`capture.request`, an import-linter contract).
"""
