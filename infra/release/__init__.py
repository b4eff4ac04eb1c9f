"""The release engineer's commands: ``reprolane release gate`` and ``reprolane release fingerprint``.

- `infra.release.gate_cli`: ``release gate`` (replay, ``--statistical`` and ``--shadow`` modes) and ``gate
  record-golden``: files read, the candidate fingerprinted, the verdict given as the exit code;
- `infra.release.gate_record`: golden sets recorded by running a workload once, on a lane or against a vendor;
- `infra.release.fingerprint`: the environment fingerprint of this machine and its model, or of a running server;
- `infra.release.fingerprint_cli`: ``release fingerprint``, its ``diff`` and its ``history``;
- `infra.release.known_good`: the known-good environments a passing gate writes to the audit bucket, read back as
  rollback targets.

The judging itself is the replayer's (`replayer.gate`); this side lives in ``infra`` because it checks a lane's
model folder against the model cache's manifest (`infra.model.manifest`), which no service may import. It imports
`schemas`, the replayer, infra's basement (`infra.clients.s3`), the model cache and infra's shared modules
(`infra.errors`, `infra.paths`, `infra.cli_options`). Nothing of ours imports it; the command tree loads its
commands by name (`infra.cli.commands`).
"""
