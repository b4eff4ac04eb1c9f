"""The release gate's judging side: a candidate environment judged against recorded answers before it ships.

One module per mode of ``reprolane release gate``, and the golden sets they share:

- `replayer.gate.golden`: golden sets (a JSONL file of envelopes, or an S3 selector): the recorded requests the
  gate replays, and `record_envelope` (a lane's answer kept as a golden envelope);
- `replayer.gate.replay`: the replay gate (the default mode): a change of the environment fingerprint replays the
  golden set on the candidate lane and judges each envelope at its level (`run_gate`, `GateReport`);
- `replayer.gate.statistical`: the statistical gate (``--statistical``) for upstreams without a seed or a version,
  judged on samples (similarity, assertions), and `replayer.gate.vendor_client`, the HTTP sampler that draws them;
- `replayer.gate.shadow`: the shadow report (``--shadow``): production against candidate over the shadow pairs
  of a time window, per request and as distributions.

It takes records and returns verdicts: it stands on the rest of the replayer (`replayer.replay`,
`replayer.compare`, `replayer.store`, `replayer.report`, `replayer.lanes.base`, `replayer.settings`,
`replayer.errors`) and `schemas`, and nothing else in ``replayer`` imports it. The command side, which reads files,
fingerprints the local model and keeps known-good environments, is `infra.release`; the console imports it too (a
request's shadow pair, a gate report). Both are named in the import-linter contract on this package.
"""
