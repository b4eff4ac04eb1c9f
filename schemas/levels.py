"""Reproducibility levels: the contract a request declares and a replay is judged against.

- ``bitwise``: identical token ids and identical per-step logprobs (frozen hardware, software, path, topology).
- ``token``: identical token ids.
- ``numeric``: per-step chosen-token logprob and top-k rank differences within thresholds over the common
  prefix of the two outputs (token ids may differ after it).
- ``semantic``: final texts judged equivalent by embedding similarity.

`LEVEL_ORDER` runs from strictest to loosest. Bitwise implies token and numeric; token and numeric are not
ordered against each other (a token-identical replay can still exceed numeric thresholds), which is why a
verdict reports the set of levels that hold, not one rank.
"""

from __future__ import annotations

from typing import Literal

ReproLevel = Literal["bitwise", "token", "numeric", "semantic"]

LEVEL_ORDER: tuple[ReproLevel, ...] = ("bitwise", "token", "numeric", "semantic")
