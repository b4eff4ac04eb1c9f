"""How reprolane runs: the basement every service stands on, and the attic that stands on every service.

Read bottom to top; import-linter's layers contract (``pyproject.toml``) checks that every import points down:

- the basement, :mod:`infra.clients`: the one Kafka and S3 client construction (TLS, SASL, timeouts, retries,
  S3's error codes), the connection fields every service's settings inherit, the stop signal, the artifact
  digest. It imports only `schemas`, and it is the only part of ``infra`` that ``capture`` and ``replayer`` import.
- the services, ``capture`` and ``replayer``, stand on it and on `schemas`.
- the attic stands on the services; nothing in them or in the basement imports any of it:

  - its shared ground, three modules at this root: `infra.errors` (infra's error tree), `infra.paths` (where the
    model cache and the stack's run dir live) and `infra.cli_options` (the options infra's commands share);
  - `infra.model`: the served model, converted, cached and verified against its manifest;
  - `infra.stack`: the local stack of SeaweedFS, Tansu and vLLM CPU, and the defaults it hands the services;
  - the features, which never import each other: `infra.release` (the release gate's and the fingerprint's
    commands), `infra.reexecution` (re-executable evidence), `infra.console` (the auditors' web application) and
    `infra.demo`;
  - on top, `infra.cli`: the ``reprolane`` command line, which loads every package's commands by name.

Beside the code, the files a deployment reads stay in their folders: ``docker/``, ``grafana/``, ``kafka/``,
``minio/``, ``prometheus/``, ``runtime/``, ``secrets/``, ``workload/``.
"""
