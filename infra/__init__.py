"""How reprolane runs: the converted model cache and the local stack of real servers.

``infra`` owns everything that starts, stops or fetches something outside Python: the model
(:mod:`infra.model`), the local stack of Tansu, SeaweedFS and vLLM CPU (:mod:`infra.stack`) and the
``reprolane`` command line (:mod:`infra.cli`). It depends on no other package of ours, so the lead's
``schemas``/``capture``/``replayer`` can use it from tests without pulling anything heavy.
"""
