"""Prometheus metrics of the replayer, in a registry of their own (never the process-global default).

reprolane_replays_total{lane,verdict,target_level,runtime_fingerprint}
                                                   replays that produced a new stored result
reprolane_replay_target_met_total{lane,target_level,runtime_fingerprint}     ... whose target level held
reprolane_replay_target_missed_total{lane,target_level,runtime_fingerprint}  ... whose target level did not hold
reprolane_replay_first_divergence_position{lane,runtime_fingerprint}
                                                   histogram: index of the first differing token
reprolane_replay_latency_seconds{lane}             histogram: wall time of the lane's replay
reprolane_replay_deduplicated_total                redeliveries answered from the stored result (not counted
                                                   again above: at-least-once delivery never double counts)
reprolane_replayer_dead_letters_total{reason}      messages sent to the dead-letter topic
reprolane_replayer_not_replayable_total            selected envelopes that cannot be replayed (skipped)
reprolane_replayer_not_selected_total              envelopes neither flagged nor sampled (skipped)
reprolane_replayer_retries_total{error}            messages re-read after a store/lane/broker error
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from schemas import DivergenceEvent

#: ``runtime_fingerprint`` label: the first hex digits of the *recorded* envelope's runtime sha256, so
#: dashboards can split divergence by production environment (bounded cardinality: one per deployment).
FINGERPRINT_LABEL_CHARS = 12

_POSITION_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ReplayerMetrics:
    """The replayer's counters and histograms (see module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        by_level = ["lane", "target_level", "runtime_fingerprint"]
        self.replays = Counter("reprolane_replays", "Replays stored", ["verdict", *by_level], registry=r)
        self.target_met = Counter(
            "reprolane_replay_target_met", "Replays whose target level held", by_level, registry=r
        )
        self.target_missed = Counter(
            "reprolane_replay_target_missed", "Replays whose target level did not hold", by_level, registry=r
        )
        self.first_divergence_position = Histogram(
            "reprolane_replay_first_divergence_position",
            "Index of the first differing generated token",
            ["lane", "runtime_fingerprint"],
            buckets=_POSITION_BUCKETS,
            registry=r,
        )
        self.replay_latency = Histogram(
            "reprolane_replay_latency_seconds",
            "Wall time of one replay on the lane",
            ["lane"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.deduplicated = Counter(
            "reprolane_replay_deduplicated", "Redeliveries answered from the stored result", registry=r
        )
        self.dead_letters = Counter(
            "reprolane_replayer_dead_letters", "Messages sent to the dead-letter topic", ["reason"], registry=r
        )
        self.not_replayable = Counter(
            "reprolane_replayer_not_replayable", "Selected envelopes that cannot be replayed", registry=r
        )
        self.not_selected = Counter("reprolane_replayer_not_selected", "Envelopes not selected for replay", registry=r)
        self.retries = Counter("reprolane_replayer_retries", "Messages re-read after an error", ["error"], registry=r)

    def observe_replay(self, event: DivergenceEvent, seconds: float, runtime_sha256: str = "") -> None:
        """Count one new replay result (call once per stored result, never for a redelivery).

        `runtime_sha256` is the recorded envelope's ``runtime.sha256()`` (the production environment)."""
        lane, fp = event.lane, runtime_sha256[:FINGERPRINT_LABEL_CHARS]
        labels = {"lane": lane, "target_level": event.target_level, "runtime_fingerprint": fp}
        self.replays.labels(verdict=event.verdict, **labels).inc()
        (self.target_met if event.target_met else self.target_missed).labels(**labels).inc()
        if event.first_divergence is not None:
            self.first_divergence_position.labels(lane=lane, runtime_fingerprint=fp).observe(
                event.first_divergence.position
            )
        self.replay_latency.labels(lane=lane).observe(seconds)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Sum of the samples called `name` whose labels include `labels` (0.0 when none): for tests and the CLI.

        A subset match, so ``value("reprolane_replays_total", {"lane": "vllm"})`` adds up every verdict,
        target level and runtime fingerprint."""
        wanted = (labels or {}).items()
        return sum(
            sample.value
            for metric in self.registry.collect()
            for sample in metric.samples
            if sample.name == name and wanted <= sample.labels.items()
        )

    def serve(self, port: int, addr: str = "127.0.0.1") -> WSGIServer:
        """Expose the registry over HTTP on ``addr:port`` (port 0: any free one; see ``.server_port``)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
