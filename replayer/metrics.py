"""Prometheus metrics of the replayer, in a registry of their own (never the process-global default).

reprolane_replays_total{lane,verdict}              replays that produced a new stored result
reprolane_replay_target_met_total{lane}            ... whose target level held
reprolane_replay_target_missed_total{lane}         ... whose target level did not hold
reprolane_replay_first_divergence_position{lane}   histogram: index of the first differing token
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

_POSITION_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ReplayerMetrics:
    """The replayer's counters and histograms (see module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.replays = Counter("reprolane_replays", "Replays stored", ["lane", "verdict"], registry=r)
        self.target_met = Counter(
            "reprolane_replay_target_met", "Replays whose target level held", ["lane"], registry=r
        )
        self.target_missed = Counter(
            "reprolane_replay_target_missed", "Replays whose target level did not hold", ["lane"], registry=r
        )
        self.first_divergence_position = Histogram(
            "reprolane_replay_first_divergence_position",
            "Index of the first differing generated token",
            ["lane"],
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

    def observe_replay(self, event: DivergenceEvent, seconds: float) -> None:
        """Count one new replay result (call once per stored result, never for a redelivery)."""
        lane = event.lane
        self.replays.labels(lane=lane, verdict=event.verdict).inc()
        (self.target_met if event.target_met else self.target_missed).labels(lane=lane).inc()
        if event.first_divergence is not None:
            self.first_divergence_position.labels(lane=lane).observe(event.first_divergence.position)
        self.replay_latency.labels(lane=lane).observe(seconds)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (0.0 when absent): for tests and the CLI."""
        got = self.registry.get_sample_value(name, labels or {})
        return 0.0 if got is None else got

    def serve(self, port: int, addr: str = "127.0.0.1") -> WSGIServer:
        """Expose the registry over HTTP on ``addr:port`` (port 0: any free one; see ``.server_port``)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
