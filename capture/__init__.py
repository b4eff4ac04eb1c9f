"""The capture sidecar: a transparent OpenAI-compatible proxy that records every request as an envelope.

Two paths meet at the spool, and never import each other (import-linter contracts):

- `request/`: the request path, what handles one client request: the HTTP server and its bounds, callers and
  their keys, the ASGI app and the capture endpoints, the answer whole or streamed, pass-through, the upstream
  client, the runtime fingerprint, the envelope and its append to the spool, the span, shadow traffic (its
  `__init__` lists its modules).
- `spool/`: the append-only local log with group-committed fsync; nothing leaves it unacknowledged.
- `publishing/`: the publishing path: the publisher drains the spool to Kafka and S3 (Object Lock), at least once,
  sealing encrypted tenants first, through its sinks (Kafka, S3 with optional worker processes, the Merkle log's
  ``audit-log`` sink), and quarantines a record a sink refuses for good.

Shared by both, at the top:

- `settings`: the one settings object of the process (env prefix ``REPROLANE_CAPTURE_``).
- `errors`: the sidecar's error tree; `metrics`: Prometheus metrics on the sidecar's own ``/metrics``.
- `cli`: ``reprolane serve capture`` and the key commands: builds the settings, the spool, the publisher
  (publishing path) and the app (request path), whose lifespan starts and stops the publisher as a `Startable`.

And the sub-packages the paths use or that stand beside them:

- `protocol/`: the protocol per endpoint (`chat`, `completions`, `responses`, `messages`) and what they share:
  audit fields added and stripped, the sampling contract, the collected output, token spellings, SSE framing.
- `ledger/`: what the sidecar writes and the audit jobs read (the Merkle log appender, sealing and data keys);
  the sidecar's modules import it, and of the jobs' package `audit/` nothing.
- `schedule/`: the engine's schedule log (issue 22): the recorder vLLM loads, and the shipper beside vLLM that
  delivers its closed segments to S3 and Kafka like envelopes (`reprolane serve schedules`).
- `audit/`: the audit-evidence jobs (verify, checkpoints, retention, the lake); they never import the sidecar.
"""
