"""Which captured requests are flagged for replay (pure: no IO, no clock, no randomness).

Everything is captured; flagging only marks an envelope for the replayer. Three rules, checked in order, the
first that matches names the reason:

1. ``header``: the client sent ``X-Reprolane-Flag: 1`` (or ``true``, ``yes``, ``on``; case-insensitive).
2. ``tenant``: the request's tenant is in the configured list.
3. ``sample``: a deterministic sample on the request id: sha256(request_id), read as a 256-bit number and
   divided by 2**256, is a point in [0, 1); the request is in when that point is below the rate. The same
   request id is therefore always in or always out, on every sidecar, after every restart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

FlagReason = Literal["header", "tenant", "sample"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_SPAN = float(2**256)


@dataclass(frozen=True, slots=True)
class FlagDecision:
    flagged: bool
    reason: FlagReason | None


NOT_FLAGGED = FlagDecision(False, None)


def header_asks_flag(value: str | None) -> bool:
    """True when the ``X-Reprolane-Flag`` header value asks for replay."""
    return value is not None and value.strip().lower() in _TRUE


def sample_point(request_id: str) -> float:
    """The request id's fixed position in [0, 1): sha256 as a big-endian number over 2**256."""
    digest = hashlib.sha256(request_id.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") / _SPAN


class ReplayPolicy:
    """The flagging rules of one sidecar, built once from settings."""

    def __init__(self, *, flag_tenants: Iterable[str] = (), sample_rate: float = 0.0) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample_rate must lie in [0, 1], got {sample_rate}")
        self.flag_tenants = frozenset(flag_tenants)
        self.sample_rate = sample_rate

    def decide(self, *, request_id: str, tenant: str, flag_header: str | None) -> FlagDecision:
        if header_asks_flag(flag_header):
            return FlagDecision(True, "header")
        if tenant in self.flag_tenants:
            return FlagDecision(True, "tenant")
        if self.sample_rate > 0.0 and sample_point(request_id) < self.sample_rate:
            return FlagDecision(True, "sample")
        return NOT_FLAGGED
