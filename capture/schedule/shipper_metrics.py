"""Prometheus metrics of the schedule shipper, served on its own port (``metrics_port``; 0: none).

A private `CollectorRegistry` per instance (never the process-global one), as the sidecar's metrics:

    reprolane_shipper_segments_shipped_total           segments stored in S3, sent to Kafka and deleted
    reprolane_shipper_bytes_shipped_total              their bytes
    reprolane_shipper_segments_quarantined_total{code}  segments refused for good, moved to the quarantine
    reprolane_shipper_errors_total                     failed attempts (S3 or Kafka down): retried
    reprolane_shipper_index_conflicts_total            index entries another arrival had written first (kept)
    reprolane_shipper_pending_segments                 closed segments on disk not shipped yet
    reprolane_shipper_oldest_pending_seconds           age of the oldest of them (alert: shipping stalled)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class ShipperMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.segments_shipped_total = Counter(
            "reprolane_shipper_segments_shipped", "segments stored in S3, sent to Kafka and deleted", registry=r
        )
        self.bytes_shipped_total = Counter("reprolane_shipper_bytes_shipped", "bytes of shipped segments", registry=r)
        self.segments_quarantined_total = Counter(
            "reprolane_shipper_segments_quarantined", "segments refused for good, quarantined", ["code"], registry=r
        )
        self.errors_total = Counter("reprolane_shipper_errors", "failed shipping attempts (retried)", registry=r)
        self.index_conflicts_total = Counter(
            "reprolane_shipper_index_conflicts", "index entries another arrival had written first", registry=r
        )
        self.pending_segments = Gauge("reprolane_shipper_pending_segments", "closed segments not shipped", registry=r)
        self.oldest_pending_seconds = Gauge(
            "reprolane_shipper_oldest_pending_seconds", "age of the oldest closed segment not shipped", registry=r
        )

    def serve(self, port: int, host: str) -> None:
        """Serve ``/metrics`` on `host`:`port` from a daemon thread."""
        start_http_server(port, addr=host, registry=self.registry)
