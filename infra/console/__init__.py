"""``reprolane serve console``: the auditors' web application.

It reads what the capture side and the replayer wrote (envelopes and their indexes, replay results, the audit
lake, the Merkle log and its checkpoints, legal holds) and lets an operator key with the right role act on it
(legal holds, on-demand replays, evidence bundles), logging every action to the audit bucket's one access log.
It lives in ``infra`` because it reads both `capture.audit` and `replayer`, which never import each other;
nothing in ``capture`` or ``replayer`` imports it (import-linter contract "the console is a leaf of infra",
docs/ARCHITECTURE.md).

- `operators`: who a user is: an operator key proved against the operator key store (`capture.ledger.key_file`,
  `capture.audit.operators`: the CLI's keys, roles and rule);
- `sessions`: server-side sessions and their CSRF tokens;
- the access log is the CLI's (`capture.audit.access_log`: one write-once record per action or refusal);
- `records`: every read, each from its one home (`replayer.store`, `capture.audit.lake.query`, `capture.audit.verify`,
  `capture.audit.evidence.export`);
- `forms`: what the browser sends, parsed at the edge; `request_view`: a replay as an auditor reads it;
- `charts`: plotly figures, drawn by the plotly.js that the ``plotly`` package ships;
- `replay_now`: "replay now", a signed request the running replayer service answers;
- `app`: routes and the gate; `cli`: ``reprolane serve console``.
"""
