"""The capture sidecar: a transparent OpenAI-compatible proxy that records every request as an envelope.

- `settings`: the one settings object of the process (env prefix ``REPROLANE_CAPTURE_``).
- `app`: the ASGI app: the capture paths dispatched straight to `proxy`, Starlette for the rest; lifespan.
- `proxy`: the capture endpoints: request read and parsed, accounting, the last-resort 500.
- `non_streaming` / `streaming`: a captured request answered whole, or as a stream; `forwarding`: what they
  share (the upstream call, the outcome recorded in the mode's order).
- `passthrough`: every path not captured, forwarded byte for byte, counted (refused under refuse_uncaptured).
- `request_headers`: the request id and the ``X-Reprolane-*`` headers of a captured request.
- `edge`: ASGI plumbing (bodies, headers, JSON, OpenAI-format errors, disconnects, recent request ids).
- `http_server`: uvicorn as `serve capture` runs it: the parser pinned, concurrency bounded, heads on a deadline.
- `upstream`: the pooled aiohttp client for the inference server, its errors translated.
- `protocol`: the protocol per endpoint (`chat`, `completions`, `responses`, `messages`) and what they share:
  audit fields added and stripped, the sampling contract, the collected output, token spellings, SSE framing.
- `assembly`: the envelope (and its canonical bytes) from what was gathered (`RequestContext`, the collector).
- `envelope_writer`: builds each request's envelope and appends it to the spool per mode (guaranteed: before
  release; best_effort: after).
- `runtime`: artifact hashes from the manifest, the runtime fingerprint from /version + the runtime file.
- `policy`: which requests are flagged for replay.
- `spool`: the append-only local log with group-committed fsync; nothing leaves it unacknowledged.
- `publisher`: drains the spool to Kafka and S3 (Object Lock), at least once, sealing encrypted tenants first
  (`sinks`: `kafka_sink`, `s3_sink`, the record they take `outgoing`, and the Merkle log's ``audit-log`` sink;
  S3 PUTs optionally in worker processes: `s3_workers`).
- `metrics`: Prometheus metrics on the sidecar's own ``/metrics``.
- `ledger/`: what the sidecar writes and the audit jobs read (the Merkle log appender, sealing and data keys);
  the sidecar's modules import it, and of the jobs' package `audit/` nothing.
- `schedule/`: the engine's schedule log (issue 22): the recorder vLLM loads, and the shipper beside vLLM that
  delivers its closed segments to S3 and Kafka like envelopes (`reprolane serve schedules`).
- `audit/`: the audit-evidence jobs (verify, checkpoints, retention, the lake); they never import the sidecar.
"""
