"""The request path: what the sidecar does with one client request, from the socket to the spool append.

    uvicorn (`http_server`) -> `app` -> `auth` -> `proxy` -> `non_streaming` / `streaming` (`forwarding`)
        -> `upstream` (the inference server) -> the client's answer; `envelope_writer` -> the spool

- `http_server`: uvicorn as `serve capture` runs it: the parser pinned, concurrency bounded, heads on a deadline;
  `connection_limits`: connections capped in all and per address, keyed callers served first.
- `app`: the ASGI app: the capture paths dispatched straight to `proxy`, Starlette for the rest; lifespan.
- `auth`: callers and their API keys (tenant, roles), the ASGI middleware that authenticates them.
- `proxy`: the capture endpoints: request read and parsed, accounting, the last-resort 500.
- `non_streaming` / `streaming`: a captured request answered whole, or as a stream; `forwarding`: what they
  share (the upstream call, the outcome recorded in the mode's order).
- `passthrough`: every path not captured, forwarded byte for byte, counted (refused under refuse_uncaptured).
- `request_headers`: the request id and the ``X-Reprolane-*`` headers of a captured request; `policy`: which
  requests are flagged for replay.
- `edge`: ASGI plumbing (bodies, headers, JSON, OpenAI-format errors, disconnects, recent request ids).
- `upstream`: the pooled aiohttp client for the inference server, its errors translated; `runtime`: artifact
  hashes from the manifest, the runtime fingerprint from /version + the runtime file.
- `assembly`: the envelope (and its canonical bytes) from what was gathered (`RequestContext`, the collector);
  `envelope_writer`: builds each request's envelope and appends it to the spool per mode (guaranteed: before
  release; best_effort: after).
- `telemetry`: one OpenTelemetry span per captured request (off by default).
- `shadow`: a deterministic sample of requests sent again to a candidate server, its answers spooled as pairs.

May import `capture.settings`, `capture.errors`, `capture.metrics`, `capture.protocol` (which never imports this
package), `capture.ledger` (the key-file format), `schemas` and `infra.clients`. It writes to the spool through
`envelope_writer.SpoolLike`, the part of `capture.spool.Spool` it needs, and never imports the publishing path
(`capture.publishing`, an import-linter contract): the two meet only at the spool; `capture.cli` builds the
publisher and hands it to `app`, whose lifespan starts and stops it as an `app.Startable`.
"""
