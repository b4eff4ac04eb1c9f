"""The replayer: replays flagged or sampled envelopes on a frozen deterministic lane and reports divergence.

- `settings`: the one settings object of the process (env prefix ``REPROLANE_REPLAYER_``).
- `lanes/`: execution lanes behind one small interface (vLLM in process, a remote OpenAI-compatible server,
  a transformers reference lane). Heavy imports live only there, inside functions.
- `compare`: pure, vectorised comparison of recorded vs replayed outputs against the reproducibility levels.
- `replay`: one envelope through one lane into a `schemas.ReplayResult`.
- `store`: envelopes and replay results in S3 (lookup by request id, idempotent result writes).
- `service`: the FastStream consumer (selection, dead letters, on-demand replays, commit after publish+store).
- `report`: the readable report the CLI prints.
- `golden`: golden sets (JSONL of envelopes or an S3 selector) for the release gate.
- `gate`: the release gate: a fingerprint change replays the golden set on the candidate and judges it.
- `vendor_gate` / `vendor_client`: the statistical gate for upstreams without a seed or version.
"""
