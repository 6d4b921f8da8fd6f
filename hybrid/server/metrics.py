"""``GET /metrics``: the server's counters, gauges and latency histograms in Prometheus' text format.

Written by hand (the exposition format is a few lines of text; no prometheus-client dependency).
Counters and histograms are updated by the engine-loop thread and read by the HTTP thread, so
each metric takes a lock. Gauges are a snapshot the loop thread publishes after every step.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

# Seconds. TTFT spans a queue wait plus a prefill; inter-token latency one engine step.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Counter:
    def __init__(self, name: str, help: str, label: str | None = None):
        self.name, self.help, self.label = name, help, label
        self._values: dict[str, float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        with self._lock:
            self._values[label_value] = self._values.get(label_value, 0.0) + amount

    def value(self, label_value: str = "") -> float:
        with self._lock:
            return self._values.get(label_value, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            values = dict(self._values) or {"": 0.0}
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for lv, v in sorted(values.items()):
            labels = f'{{{self.label}="{lv}"}}' if self.label and lv else ""
            lines.append(f"{self.name}{labels} {_num(v)}")
        return lines


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = next((k for k, b in enumerate(self.buckets) if seconds <= b), len(self.buckets))
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        running = 0
        for bound, c in zip((*self.buckets, math.inf), counts, strict=True):
            running += c
            le = "+Inf" if bound == math.inf else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {running}')
        lines += [f"{self.name}_sum {_num(total)}", f"{self.name}_count {running}"]
        return lines


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


_GAUGES = {
    "running": "requests the engine is running (holding cache)",
    "waiting": "requests queued for cache or batch room",
    "kv_blocks_total": "KV cache blocks in the pool",
    "kv_blocks_in_use": "KV cache blocks held by requests",
    "state_slots_total": "Mamba state slots (the most sequences in flight)",
    "state_slots_in_use": "Mamba state slots held by requests",
    "cache_bytes_total": "bytes of KV blocks plus state slots",
    "cache_bytes_in_use": "bytes of KV blocks plus state slots held by requests",
}


class ServerMetrics:
    PREFIX = "hybrid_"

    def __init__(self):
        p = self.PREFIX
        self.prompt_tokens = Counter(p + "prompt_tokens_total",
                                     "prompt tokens of accepted requests (counted per choice)")
        self.generation_tokens = Counter(p + "generation_tokens_total", "tokens generated")
        self.requests_finished = Counter(p + "requests_finished_total",
                                         "engine requests finished, by reason (length, stop, abort, error)",
                                         label="finish_reason")
        self.requests_rejected = Counter(p + "requests_rejected_total", "HTTP requests refused with a 4xx error")
        self.engine_steps = Counter(p + "engine_steps_total", "engine steps run")
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "from the HTTP request's arrival to its first generated token", TTFT_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds",
                             "between consecutive generated tokens of one request", ITL_BUCKETS)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "from arrival to the last token of an engine request", E2E_BUCKETS)
        self.snapshot = EngineSnapshot()

    def render(self) -> str:
        lines: list[str] = []
        snap = self.snapshot
        for field, help in _GAUGES.items():
            name = f"{self.PREFIX}{field}"
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name} {getattr(snap, field)}"]
        for m in (self.prompt_tokens, self.generation_tokens, self.requests_finished, self.requests_rejected,
                  self.engine_steps, self.ttft, self.itl, self.e2e):
            lines += m.render()
        return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def parse_metrics(text: str) -> dict[str, float]:
    """``name{labels} value`` lines -> {"name{labels}": value} (for tests and the load benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
