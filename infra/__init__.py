"""How reprolane runs: the clients every service builds, the converted model cache and the local stack.

``infra`` owns everything that starts, stops or fetches something outside Python, in two layers:

- :mod:`infra.clients` is the leaf every service uses: the one Kafka and S3 client construction (TLS, SASL,
  timeouts, retries, S3's error codes). It imports only :mod:`schemas`, so ``capture`` and ``replayer`` import
  it without pulling in anything else of ``infra``.
- The rest sits on top and may import ``capture`` and ``replayer``: the model (:mod:`infra.model.cache`), the local
  stack of Tansu, SeaweedFS and vLLM CPU (:mod:`infra.stack.launcher`), the demo, and the ``reprolane`` command line
  (:mod:`infra.cli`), which registers every service's commands. Nothing in ``capture`` or ``replayer``
  imports it.
"""
