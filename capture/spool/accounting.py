"""The spool's bound: the bytes it holds pending against ``max_bytes``, said once in the log and in metrics.

`SpoolBound.bytes` counts the pending records (record headers included); `reserved` the appends queued and not
yet written. An append that would take their sum past ``max_bytes`` is refused at once (`reserve` raises
`SpoolFullError`): invariant 6 of `capture.spool`. The spool logs one WARNING when it reaches ``warn_ratio`` of
the bound and one ERROR when it first refuses an append, each again only after it has drained below; the
gauges ``spool_depth`` and ``spool_bytes`` follow every change.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from capture.errors import SpoolFullError

if TYPE_CHECKING:
    from capture.metrics import CaptureMetrics

log = logging.getLogger(__name__)


class SpoolBound:
    """Pending and reserved bytes of one spool, checked against its bound (touched on the event loop only)."""

    def __init__(self, directory: Path, *, max_bytes: int, warn_ratio: float, metrics: CaptureMetrics | None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.warn_ratio = warn_ratio
        self._metrics = metrics
        self.bytes = 0  # pending records, headers included
        self.reserved = 0  # appends queued but not yet written
        self._warned = False
        self._full_logged = False

    def reserve(self, size: int) -> None:
        """Hold `size` bytes for an append about to be queued; `SpoolFullError` when they do not fit."""
        if self.bytes + self.reserved + size > self.max_bytes:
            if not self._full_logged:
                self._full_logged = True
                log.error(
                    "spool %s FULL: %d pending bytes + %d would exceed max_bytes=%d; appends are refused "
                    "until the publisher drains (are Kafka and S3 reachable?)",
                    self.directory,
                    self.bytes + self.reserved,
                    size,
                    self.max_bytes,
                )
            if self._metrics is not None:
                self._metrics.spool_full_total.inc()
            raise SpoolFullError(
                f"spool {self.directory} is full: {self.bytes + self.reserved} of {self.max_bytes} bytes pending"
            )
        self.reserved += size

    def grew(self, depth: int) -> None:
        """After records were written (their bytes added): warn once at ``warn_ratio``; update the gauges."""
        threshold = self.warn_ratio * self.max_bytes
        if not self._warned and self.bytes >= threshold:
            self._warned = True
            log.warning(
                "spool %s is %.0f%% full (%d of %d bytes, %d records pending): the publisher is behind; "
                "appends will be refused at 100%%",
                self.directory,
                100.0 * self.bytes / self.max_bytes,
                self.bytes,
                self.max_bytes,
                depth,
            )
        self.update_metrics(depth)

    def shrank(self, depth: int) -> None:
        """After records were acknowledged (their bytes taken off): re-arm the warnings; update the gauges."""
        if self.bytes < self.warn_ratio * self.max_bytes:
            if self._warned:
                log.info("spool %s back below %.0f%% full", self.directory, 100.0 * self.warn_ratio)
            self._warned = False
        if self.bytes + self.reserved < self.max_bytes:
            self._full_logged = False
        self.update_metrics(depth)

    def update_metrics(self, depth: int) -> None:
        if self._metrics is not None:
            self._metrics.spool_depth.set(depth)
            self._metrics.spool_bytes.set(self.bytes)
