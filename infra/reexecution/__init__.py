"""Re-executable evidence: a bundle an outside party replays offline and gets the recorded output, bit for bit.

An evidence bundle (`capture.audit.evidence`) proves a record was logged and not changed since. A re-executable
one (``reprolane audit evidence export ID --reexecutable``) also carries what a replay needs: the request's
schedule window as shapes, every request id blinded, with its proof against the engine's signed schedule log
(`infra.reexecution.window`), and the model manifest (`infra.reexecution.export`). ``reprolane audit evidence
reexecute BUNDLE --model-dir DIR`` (`infra.reexecution.run`) checks it as ``evidence verify`` does, checks the
local model files and runtime against what it recorded, rebuilds the window with fillers and replays the request
on the schedule lane, with no S3, no Kafka and no network.

It joins the audit side (the bundle) and the replayer (the schedule store, the lane), which may not import each
other, so it lives in infra, on top of both; nothing imports it but the command tree.
"""
