"""Prometheus metrics of the capture sidecar, served on its own ``/metrics``.

Every `CaptureMetrics` owns a private `CollectorRegistry` (never the process-global one), so a test can build
many apps in one process and each sees only its own counts. The proxy, the spool and the publisher write to
the same instance; the app renders it.

    reprolane_capture_requests_total{endpoint,status}     requests answered, by endpoint and HTTP status
    reprolane_capture_added_latency_seconds               sidecar overhead per request (histogram, from 0.1 ms)
    reprolane_capture_upstream_seconds{endpoint}          upstream time per request (histogram)
    reprolane_capture_in_flight                           requests currently passing through
    reprolane_capture_spool_depth                         envelopes in the spool not yet published everywhere
    reprolane_capture_spool_bytes                         bytes the spool holds on disk
    reprolane_capture_spool_capacity_bytes                the spool's byte bound (alert: bytes / capacity)
    reprolane_capture_publish_lag_seconds                 age of the oldest unpublished envelope
    reprolane_capture_publish_errors_total{sink}          failed publish attempts (kafka, s3)
    reprolane_capture_envelopes_dropped_total             envelopes lost (best_effort mode, spool full)
    reprolane_capture_envelopes_published_total{sink}     envelopes acknowledged by a sink
    reprolane_capture_envelopes_spooled_total             envelopes appended to the spool
    reprolane_capture_spool_full_total                    appends refused because the spool was full
    reprolane_capture_spool_write_failures_total{reason}  spool writes the disk refused, undone (no_space, io_error)
    reprolane_capture_records_quarantined_total{sink,code}  records a sink refused for good, kept in the local
                                                          quarantine (and the dead-letter topic) and acked
    reprolane_capture_claim_checks_total                  envelopes too large for Kafka, sent as a claim check
    reprolane_capture_index_conflicts_total               index entries another record had written first (kept)
"""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Sidecar overhead is measured in fractions of a millisecond: fine buckets at the bottom.
ADDED_LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
UPSTREAM_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class CaptureMetrics:
    """All metrics of one sidecar, in one private registry."""

    def __init__(self, namespace: str = "reprolane_capture") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # every metric of the sidecar: in its registry, under its namespace
        counter = partial(Counter, namespace=namespace, registry=self.registry)
        gauge = partial(Gauge, namespace=namespace, registry=self.registry)
        histogram = partial(Histogram, namespace=namespace, registry=self.registry)
        self.requests_total = counter("requests_total", "Requests answered", ["endpoint", "status"])
        self.added_latency_seconds = histogram(
            "added_latency_seconds",
            "Time the sidecar adds to a request (total minus upstream)",
            buckets=ADDED_LATENCY_BUCKETS,
        )
        self.upstream_seconds = histogram(
            "upstream_seconds",
            "Upstream time per request, first byte sent to last byte received",
            ["endpoint"],
            buckets=UPSTREAM_BUCKETS,
        )
        self.in_flight = gauge("in_flight", "Requests currently passing through")
        self.spool_depth = gauge("spool_depth", "Envelopes in the spool not yet published to every sink")
        self.spool_bytes = gauge("spool_bytes", "Bytes the spool holds on disk")
        self.spool_capacity_bytes = gauge("spool_capacity_bytes", "The spool's byte bound")
        self.publish_lag_seconds = gauge("publish_lag_seconds", "Age of the oldest unpublished envelope")
        self.publish_errors_total = counter("publish_errors_total", "Failed publish attempts", ["sink"])
        self.envelopes_dropped_total = counter(
            "envelopes_dropped_total", "Envelopes lost because the spool was full (best_effort mode only)"
        )
        self.envelopes_published_total = counter(
            "envelopes_published_total", "Envelopes acknowledged by a sink", ["sink"]
        )
        self.envelopes_spooled_total = counter("envelopes_spooled_total", "Envelopes appended to the spool")
        self.spool_full_total = counter("spool_full_total", "Appends refused because the spool was full")
        self.spool_write_failures_total = counter(
            "spool_write_failures_total",
            "Spool writes the disk refused (no_space: full disk or short write; io_error: anything else), each "
            "undone to the last complete record; its appends were refused and the next ones try again",
            ["reason"],
        )
        self.uncaptured_total = counter(
            "uncaptured_total",
            "Requests on paths the sidecar does not capture: reads (GET, HEAD, OPTIONS) and writes passed through, "
            "writes refused (refuse_uncaptured)",
            ["kind"],
        )

        self.records_quarantined_total = counter(
            "records_quarantined_total",
            "Records a sink refused for good, quarantined locally (and dead-lettered) and acked",
            ["sink", "code"],
        )
        self.claim_checks_total = counter(
            "claim_checks_total",
            "Envelopes too large for a Kafka record, sent to Kafka as a claim check on their S3 object",
        )
        self.index_conflicts_total = counter(
            "index_conflicts_total",
            "Index entries (request id, workflow step) another record had written first: the first is kept",
        )

        self.shadow_total = counter(
            "shadow_total",
            "Shadow requests to the candidate (capture/request/shadow.py) by outcome: recorded, candidate_error, "
            "timeout, skipped (nothing to compare: no token ids, an error), dropped_queue (queue full), dropped_spool "
            "(spool above its shadow share), dropped_shutdown",
            ["outcome"],
        )

    def render(self) -> bytes:
        """The text exposition format of this registry."""
        return generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (tests and the benchmark read metrics through this); 0.0 if absent."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got
