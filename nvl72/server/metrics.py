"""Prometheus metrics of the front, under vLLM-like names with the `nvl72:` prefix.

Request latencies and token counts are measured here; engine gauges and counters (running,
waiting, KV usage, speculative decoding) are read from `EngineClient.stats()` at scrape time.
Each app has its own registry, so several servers can live in one process (tests).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)

# stats() key -> metric name (gauges); the first key present wins.
ENGINE_GAUGES = {
    "num_requests_running": ("num_requests_running", "num_running", "running"),
    "num_requests_waiting": ("num_requests_waiting", "num_waiting", "waiting"),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "kv_usage"),
}
# Cumulative engine totals exported as counters.
ENGINE_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                   "num_preemptions", "num_steps", "step_seconds", "num_eager_steps", "eager_step_seconds",
                   "num_step_periods", "step_period_seconds", "device_wait_seconds", "triton_compiles")
# Engine ratios exported as gauges when present.
ENGINE_RATIOS = ("spec_decode_acceptance_rate", "spec_decode_tokens_per_step")


class _EngineCollector:
    """Reads the engine's stats() on every scrape."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str):
        self._stats, self._model = stats, model_name

    def collect(self):
        try:
            stats = self._stats()
        except Exception as e:  # a scrape must not fail because the engine is down; /health says so
            log.warning("engine stats() failed during /metrics: %s", e)
            return
        for name, keys in ENGINE_GAUGES.items():
            key = next((k for k in keys if k in stats), None)
            if key is not None:
                g = GaugeMetricFamily(f"nvl72:{name}", f"engine {key}", labels=["model_name"])
                g.add_metric([self._model], float(stats[key]))
                yield g
        for name in ENGINE_RATIOS:
            if name in stats:
                g = GaugeMetricFamily(f"nvl72:{name}", f"engine {name}", labels=["model_name"])
                g.add_metric([self._model], float(stats[name]))
                yield g
        for name in ENGINE_COUNTERS:
            if name in stats:
                c = CounterMetricFamily(f"nvl72:{name}", f"engine {name}", labels=["model_name"])
                c.add_metric([self._model], float(stats[name]))
                yield c


class Metrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, float]]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"nvl72:{name}", doc, lab, buckets=buckets, registry=self.registry).labels(model_name)

        def count(name: str, doc: str) -> Counter:
            return Counter(f"nvl72:{name}", doc, lab, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "request arrival to first output token", _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "time between successive outputs of a request", _ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1) per request",
                         _ITL_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "engine arrival to first scheduling",
                               _LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "request arrival to last output", _LATENCY_BUCKETS)
        self.prompt_tokens = count("prompt_tokens", "prompt tokens of finished or aborted requests")
        self.generation_tokens = count("generation_tokens", "generated tokens")
        self.prefix_queries = count("prefix_cache_queries", "prompt tokens looked up in the prefix cache")
        self.prefix_hits = count("prefix_cache_hits", "prompt tokens found in the prefix cache")
        self.success = Counter("nvl72:request_success", "finished requests by finish reason",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats, model_name))

    def finished(self, reason: str) -> None:
        self.success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
