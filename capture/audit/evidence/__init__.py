"""Evidence bundles: everything an outside verifier needs about one record, in one file, checked offline.

- `capture.audit.evidence.export`: the bundle of one record, from the store and the Merkle log
  (``reprolane audit evidence export``);
- `capture.audit.evidence.bundle`: its format; `capture.audit.evidence.verify`: the offline check against a pinned
  key (``reprolane audit evidence verify``); `capture.audit.evidence.summary`: what a person reads;
- `capture.audit.evidence.cli`: the commands.

The verifier runs on a regulator's machine: `verify` and `bundle` import only schemas (a contract in
pyproject.toml), so checking a bundle needs no S3, no Kafka and none of our services.
"""
