"""Prometheus metrics of the server (GET /metrics).

One registry per server (not the process-global default), so tests can build several
apps in one process. Latencies are measured in the API process, where the client sees
them: time to first token from the arrival of the HTTP request, inter-token latency
between successive tokens of one sequence (a step that brings k tokens at once counts
k intervals of dt/k). Engine-side gauges (running, waiting, KV pages, prefix-cache hit
rate) are copied from the stats the engine process sends with its step outputs.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the server)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)

# engine stats key -> (metric name, help)
_ENGINE_GAUGES = {
    "running": ("mstar_num_requests_running", "Sequences the engine is running."),
    "waiting": ("mstar_num_requests_waiting", "Sequences waiting in the engine's queue."),
    "kv_pages_used": ("mstar_kv_cache_pages_used", "KV-cache pages in use."),
    "kv_pages_total": ("mstar_kv_cache_pages_total", "KV-cache pages in the pool."),
    "kv_usage": ("mstar_kv_cache_usage_ratio", "Fraction of the KV-cache pages in use (0..1)."),
    "prefix_hit_rate": ("mstar_prefix_cache_hit_rate", "Fraction of prompt tokens served by the prefix cache."),
    "peak_gpu_mem_bytes": ("mstar_peak_gpu_memory_bytes", "Peak GPU memory allocated by the engine (bytes)."),
}


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("mstar_requests", "HTTP generation requests by outcome "
                                "(success, aborted = client went away, bad_request, rejected = overload, error).",
                                ["endpoint", "outcome"], registry=r)
        self.finished = Counter("mstar_sequences_finished", "Sequences (choices) finished, by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("mstar_prompt_tokens", "Prompt tokens of admitted sequences.", registry=r)
        self.cached_prompt_tokens = Counter("mstar_prompt_tokens_cached",
                                            "Prompt tokens served by the prefix cache.", registry=r)
        self.generation_tokens = Counter("mstar_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("mstar_time_to_first_token_seconds", "Time from request arrival to first token.",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("mstar_inter_token_latency_seconds", "Time between successive output tokens.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("mstar_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.pending = Gauge("mstar_num_requests_pending", "Sequences admitted by the API and not yet finished "
                             "(the quantity --max-pending limits).", registry=r)
        self.engine_alive = Gauge("mstar_engine_alive", "1 while the engine process is alive.", registry=r)
        self.engine_restarts = Counter("mstar_engine_restarts", "Engine processes started after one died.",
                                       registry=r)
        self._engine = {k: Gauge(name, help, registry=r) for k, (name, help) in _ENGINE_GAUGES.items()}
        self.engine_other = Gauge("mstar_engine_stat", "Other numeric engine statistics, by name.", ["name"],
                                  registry=r)
        self.last_stats: dict[str, Any] = {}
        self.reset_engine_gauges()
        for outcome in ("success", "aborted", "bad_request", "rejected", "error"):
            for ep in ("completions", "chat"):
                self.requests.labels(ep, outcome)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)

    def reset_engine_gauges(self) -> None:
        """Every engine gauge back to zero (at start, and when the engine process dies: a dead
        engine runs nothing and holds no page)."""
        for g in self._engine.values():
            g.set(0)
        for name, v in self.last_stats.items():
            if name not in self._engine and isinstance(v, (int, float)) and not isinstance(v, bool):
                self.engine_other.labels(name).set(0)
        self.last_stats = {}

    def update_engine_stats(self, stats: dict[str, Any]) -> None:
        self.last_stats = stats
        for k, v in stats.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            g = self._engine.get(k)
            if g is not None:
                g.set(v)
            else:
                self.engine_other.labels(k).set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
