"""``GET /metrics``: the server's counters, gauges and latency histograms, through ``prometheus-client``.

``prometheus-client`` is the library Python servers (and vLLM) export with; it writes the text format
(or OpenMetrics, when a scraper asks for it in ``Accept``) and its metrics are thread-safe, so the
engine-loop thread updates counters and histograms while the HTTP thread renders them. Each
:class:`ServerMetrics` owns its own ``CollectorRegistry`` (not the process-global default), so two
servers in one process -- tests, a benchmark beside a server -- never collide on a metric name.
Gauges are a snapshot the loop thread publishes after every step, read by a collector at scrape time.
Names keep our ``hybrid_`` prefix where vLLM writes ``vllm:``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

# A ``_created`` timestamp per counter and histogram doubles the series and says nothing a rate()
# needs; vLLM, TensorRT-LLM and lmdeploy switch it off the same way (the switch is process-wide).
prometheus_client.disable_created_metrics()

# Seconds. TTFT spans a queue wait plus a prefill; inter-token latency one engine step.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

FINISH_REASONS = ("length", "stop", "abort", "error")  # exported at 0 from the start: no series appears late


@dataclass(frozen=True)
class EngineSnapshot:
    """What the loop thread last saw of the engine (published whole, read without a lock)."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_in_use: int = 0
    state_slots_total: int = 0
    state_slots_in_use: int = 0
    cache_bytes_total: int = 0
    cache_bytes_in_use: int = 0


GAUGE_HELP = {
    "running": "requests the engine is running (holding cache)",
    "waiting": "requests queued for cache or batch room",
    "kv_blocks_total": "KV cache blocks in the pool",
    "kv_blocks_in_use": "KV cache blocks held by requests",
    "state_slots_total": "Mamba state slots (the most sequences in flight)",
    "state_slots_in_use": "Mamba state slots held by requests",
    "cache_bytes_total": "bytes of KV blocks plus state slots",
    "cache_bytes_in_use": "bytes of KV blocks plus state slots held by requests",
}
assert set(GAUGE_HELP) == {f.name for f in fields(EngineSnapshot)}


class _SnapshotGauges:
    """A collector: one gauge per :class:`EngineSnapshot` field, read when the registry is scraped."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self):
        snap = self._metrics.snapshot
        for name, help in GAUGE_HELP.items():
            yield GaugeMetricFamily(ServerMetrics.PREFIX + name, help, value=getattr(snap, name))


class ServerMetrics:
    """The server's metrics in a registry of their own. Counters are ``prometheus_client`` counters
    (``requests_finished.labels(finish_reason=...).inc()``), histograms take ``observe(seconds)``."""

    PREFIX = "hybrid_"

    def __init__(self):
        p, reg = self.PREFIX, CollectorRegistry()
        self.registry = reg
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of accepted requests (counted per choice)",
                                     registry=reg)
        self.generation_tokens = Counter(p + "generation_tokens", "tokens generated", registry=reg)
        self.requests_finished = Counter(p + "requests_finished",
                                         "engine requests finished, by reason (length, stop, abort, error)",
                                         ["finish_reason"], registry=reg)
        for reason in FINISH_REASONS:
            self.requests_finished.labels(finish_reason=reason)
        self.requests_rejected = Counter(p + "requests_rejected", "HTTP requests refused with a 4xx error",
                                         registry=reg)
        self.engine_steps = Counter(p + "engine_steps", "engine steps run", registry=reg)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "from the HTTP request's arrival to its first generated token",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.queue_time = Histogram(p + "request_queue_time_seconds",
                                    "from the HTTP request's arrival to its first engine step (waiting for a slot, "
                                    "blocks or step budget)", buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "between consecutive generated tokens of one request", buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "from arrival to the last token of an engine request", buckets=E2E_BUCKETS, registry=reg)
        self.snapshot = EngineSnapshot()
        reg.register(_SnapshotGauges(self))

    def finished(self, reason: str) -> None:
        self.requests_finished.labels(finish_reason=reason).inc()

    def render(self) -> str:
        """The Prometheus text format (version 0.0.4)."""
        return prometheus_client.generate_latest(self.registry).decode()

    def exposition(self, accept: str | None) -> tuple[bytes, str]:
        """(body, content type) for a scrape with this ``Accept`` header: OpenMetrics when the scraper
        asks for it, else the text format -- the negotiation prometheus-client's own handlers do."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels} value`` lines -> {"name{labels}": value} (for tests and the load benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
