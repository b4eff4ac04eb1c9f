"""The capture sidecar: a transparent OpenAI-compatible proxy that records every request as an envelope.

- `settings`: the one settings object of the process (env prefix ``REPROLANE_CAPTURE_``).
- `proxy` / `app`: the HTTP edge (Starlette), streaming and not, pass-through for every other path.
- `edge`: ASGI plumbing (bodies, headers, OpenAI-format errors, disconnects, request ids, pass-through).
- `upstream`: the pooled aiohttp client for the inference server, its errors translated.
- `recording`: what the proxy gathers per request: audit fields added and stripped, the sampling contract,
  the collected output.
- `assembly`: the envelope (and its canonical bytes) from what was gathered.
- `recorder`: builds and spools envelopes per mode (guaranteed: before release; best_effort: after).
- `runtime`: artifact hashes from the manifest, the runtime fingerprint from /version + the runtime file.
- `policy`: which requests are flagged for replay.
- `spool`: the append-only local log with group-committed fsync; nothing leaves it unacknowledged.
- `publisher`: drains the spool to Kafka and S3 (Object Lock), at least once, sealing encrypted tenants first
  (`sinks`, and the Merkle log's ``audit-log`` sink; S3 PUTs optionally in worker processes: `s3_workers`).
- `metrics`: Prometheus metrics on the sidecar's own ``/metrics``.
- `ledger/`: what the sidecar writes and the audit jobs read (the Merkle log appender, sealing and data keys);
  the sidecar's modules import it, and of the jobs' package `audit/` nothing.
- `audit/`: the audit-evidence jobs (verify, checkpoints, retention, the lake); they never import the sidecar.
"""
