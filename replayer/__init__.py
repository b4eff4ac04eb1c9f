"""The replayer: replays flagged or sampled envelopes on a frozen deterministic lane and reports divergence.

What it may import: `schemas` (the contract) and `infra.clients` (the shared Kafka/S3 clients); never `capture`.
The heavy libraries (torch, vllm, transformers) are imported only in `replayer.lanes` and `replayer.semantic`,
and there only inside functions, so importing any other module (the CLI, the service, the gates) loads none of
them.

- `settings`: the one settings object of the process (env prefix ``REPROLANE_REPLAYER_``).
- `errors`: the package's error tree.
- `lanes/`: execution lanes behind one small interface (vLLM in process, a remote OpenAI-compatible server,
  a transformers reference lane), and the batch engine the matrix runs (`lanes.batch_engine`).
- `compare`: pure, vectorised comparison of recorded vs replayed outputs against the reproducibility levels.
- `semantic`: sentence-embedding similarity of two texts (offline), for the semantic level and the vendor gate.
- `replay`: one envelope through one lane into a `schemas.ReplayResult`.
- `selection`: which envelopes the service replays, and why one cannot be.
- `store`: envelopes and replay results in S3 (lookup by request id, idempotent result writes).
- `service`: the FastStream consumer (selection, dead letters, on-demand replays, commit after publish+store).
- `request_keys`: the keys file of who may sign an on-demand replay request (0600, refused when untrustworthy).
- `metrics`: the service's Prometheus metrics, in a registry of their own.
- `report`: the readable report of one replay or one workflow.
- `gate/`: the release gate, one module per mode: a fingerprint change replays the golden set on the candidate
  and judges it (`gate.replay`, the golden sets in `gate.golden`); the statistical gate for upstreams without a
  seed or version (`gate.statistical`, its HTTP sampler `gate.vendor_client`); the shadow report (`gate.shadow`).
- `matrix/`: the replay matrix (one request set across engine configurations and schedules), and ``explain``
  (one request re-run under targeted variations, to name what reproduces its fork).
- `cli`: the ``replay`` and ``replayer`` commands (the matrix's ``matrix`` and ``explain`` are in `matrix.cli`).
"""
