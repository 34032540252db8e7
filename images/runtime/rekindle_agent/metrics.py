"""Prometheus metrics of the agent: one histogram per flow, labelled by phase."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from rekindle_contract import api

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.boot_seconds = Histogram(
            "rekindle_boot_seconds",
            "Normal vLLM boot, start to ready",
            buckets=BUCKETS,
            registry=r,
        )
        self.restore_phase_seconds = Histogram(
            "rekindle_restore_phase_seconds",
            "Restore phases (total = start to ready)",
            ["phase"],
            buckets=BUCKETS,
            registry=r,
        )
        self.checkpoint_phase_seconds = Histogram(
            "rekindle_checkpoint_phase_seconds",
            "Checkpoint phases",
            ["phase"],
            buckets=BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "rekindle_fallbacks_total",
            "Restores that fell back to a normal boot",
            ["reason"],
            registry=r,
        )
        self.checkpoints = Counter(
            "rekindle_checkpoints_total", "Checkpoint attempts by result", ["result"], registry=r
        )
        self.state = Gauge(
            "rekindle_state", "1 for the agent's current state", ["state"], registry=r
        )
        self.inflight = Gauge(
            "rekindle_inflight_requests", "Proxied requests in flight", registry=r
        )
        self.refused = Counter(
            "rekindle_refused_requests_total", "Requests refused with 503 (not ready)", registry=r
        )
        self.load_reads = Counter(
            "rekindle_serve_load_reads_total",
            "GET /get_load answered on the serve port (a load-aware router polling this replica)",
            registry=r,
        )
        self.ready_seconds = Gauge(
            "rekindle_time_to_ready_seconds",
            "Agent start to ready, by path",
            ["path"],
            registry=r,
        )
        for reason in api.FALLBACK_REASONS:
            self.fallbacks.labels(reason)  # export zeros: alerts need the series to exist
        for s in api.STATES:
            self.state.labels(s).set(0)

    def set_state(self, state: str) -> None:
        for s in api.STATES:
            self.state.labels(s).set(1 if s == state else 0)

    def observe_phases(self, hist: Histogram, phases: dict[str, float]) -> None:
        for phase, secs in phases.items():
            hist.labels(phase).observe(secs)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
