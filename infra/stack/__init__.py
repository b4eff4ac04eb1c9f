"""The local stack: SeaweedFS (S3), Tansu (Kafka) and vLLM CPU as real processes on 127.0.0.1, and the defaults
it hands the services.

- `infra.stack.launcher`: `LocalStack`, the one entry point (``reprolane stack ...``, the test fixtures, the demo);
- `infra.stack.servers`: the three servers described as data (ports, command line, readiness);
  `infra.stack.process`: one server's process group started, watched and stopped; `infra.stack.ports`: loopback
  ports; `infra.stack.probes`: readiness asked in each server's own protocol;
- `infra.stack.state`: the state file (``<run-dir>/stack.json``) and `StackInfo`, the addresses a client reads;
- `infra.stack.buckets`, `infra.stack.topics`: the buckets and topics the pipeline needs, made idempotently;
- `infra.stack.env`: a running stack's addresses and secret files as defaults of the services' settings;
- `infra.stack.cli`: ``reprolane stack``.

It stands above the services (they never import it) but needs none of them: it imports `schemas`, infra's
basement (`infra.clients`), the model cache (`infra.model`, for vLLM's model, inside a function) and infra's
shared modules (`infra.errors`, `infra.paths`, `infra.cli_options`). The CLI root, the demo and the console
import it.
"""
