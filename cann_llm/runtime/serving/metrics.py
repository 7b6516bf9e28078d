"""Prometheus metrics of the server, with vLLM's names and types under a prefix (`cann_llm:` by default;
`--metrics-prefix vllm:` makes vLLM's Grafana dashboards read them as they are).

Counters are counters (`_total`), never with `_created` series; what the engines count themselves (prefix
cache, preemptions, speculation) is read from them at scrape time by a collector. Request histograms split
a request's life as vLLM does: queue (arrival to first scheduled), prefill (to the first token), decode (to
the last), inference (prefill + decode), end to end.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
# vLLM's: powers of two to the largest step budget its CUDA graphs are captured for
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
OUTCOMES = ("completed", "rejected", "cancelled", "failed")
DEFAULT_PREFIX = "cann_llm:"

# the creation-time series double every counter and no vLLM dashboard reads them
prometheus_client.disable_created_metrics()


class _EngineCollector:
    """The engines' own gauges and counters, read when scraped."""

    GAUGES = {
        "num_requests_running": ("Sequences in the running batch", lambda e: len(e.scheduler.running)),
        "num_requests_waiting": ("Sequences waiting to be scheduled", lambda e: len(e.scheduler.waiting)),
        "kv_cache_usage_perc": ("Fraction of KV pages owned by sequences (0-1)",
                                lambda e: e.blocks.num_used / e.blocks.num_pages),
        # the pool is mapped lazily and a page once written stays resident (the prefix cache keeps it): this,
        # not the usage above, is what the pool holds of the process's memory. A contiguous engine's caches
        # live and go with its requests: 0
        "kv_cache_resident_bytes": ("Bytes of the KV pool written so far, resident from then on (paged)",
                                    lambda e: e.blocks.touched * e.kv_bytes_per_page if e.paged else 0),
    }
    COUNTERS = {
        "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", lambda e: e.blocks.prefix_queries),
        "prefix_cache_hits": ("Prompt tokens found in the prefix cache", lambda e: e.blocks.prefix_hits),
        "num_preemptions": ("Sequences preempted by recompute", lambda e: e.stats.preemptions),
        "spec_decode_num_draft_tokens": ("Draft tokens proposed by prompt lookup", lambda e: e.stats.draft_tokens),
        "spec_decode_num_accepted_tokens": ("Draft tokens the model agreed with", lambda e: e.stats.accepted_tokens),
    }

    def __init__(self, engines: dict, prefix: str):
        self.engines, self.prefix = engines, prefix

    def collect(self):
        for name, (text, read) in self.GAUGES.items():
            family = GaugeMetricFamily(self.prefix + name, text, labels=["model_name"])
            for model, engine in self.engines.items():
                family.add_metric([model], read(engine))
            yield family
        for name, (text, read) in self.COUNTERS.items():
            family = CounterMetricFamily(self.prefix + name, text, labels=["model_name"])
            for model, engine in self.engines.items():
                family.add_metric([model], read(engine))
            yield family
        family = HistogramMetricFamily(self.prefix + "iteration_tokens_total", "Tokens per engine step",
                                       labels=["model_name"])
        for model, engine in self.engines.items():
            steps = dict(engine.stats.step_tokens)  # a copy: the engine's thread adds to it
            buckets = [(str(float(bound)), sum(n for tokens, n in steps.items() if tokens <= bound))
                       for bound in _STEP_TOKEN_BUCKETS] + [("+Inf", sum(steps.values()))]
            family.add_metric([model], buckets, sum(tokens * n for tokens, n in steps.items()))
        yield family


class ServerMetrics:
    """One registry per server: request counters and histograms observed as requests end, the engines'
    state read when scraped, and Prometheus' process metrics (as vLLM's default registry has them)."""

    def __init__(self, engines: dict, prefix: str = DEFAULT_PREFIX):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_EngineCollector(engines, prefix))
        label = ["model_name"]

        def histogram(name: str, text: str, buckets) -> Histogram:
            return Histogram(prefix + name, text, label, buckets=buckets, registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.inter_token = histogram("inter_token_latency_seconds", "Time between output tokens", _LATENCY_BUCKETS)
        self.request_per_output_token = histogram("request_time_per_output_token_seconds",
                                                  "A request's decode time per output token after the first",
                                                  _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, end to end", _REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting before first scheduled", _REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from first scheduled to the first token",
                                 _REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last", _REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time from first scheduled to the last token",
                                   _REQUEST_BUCKETS)
        self.prompt_histogram = histogram("request_prompt_tokens", "Prompt tokens of a request", _TOKEN_BUCKETS)
        self.generation_histogram = histogram("request_generation_tokens", "Tokens generated for a request",
                                              _TOKEN_BUCKETS)
        self.max_tokens = histogram("request_params_max_tokens", "max_tokens asked for", _TOKEN_BUCKETS)
        self.requests = Counter(prefix + "requests", "Requests by outcome (completed, rejected, cancelled, failed)",
                                label + ["outcome"], registry=self.registry)
        self.success = Counter(prefix + "request_success", "Completed requests by finish reason",
                               label + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter(prefix + "prompt_tokens", "Prompt tokens", label, registry=self.registry)
        self.generation_tokens = Counter(prefix + "generation_tokens", "Generated tokens", label, registry=self.registry)
        for model in engines:
            for outcome in OUTCOMES:
                self.requests.labels(model, outcome)

    def finished(self, model: str, stats, finish_reason: str | None, outcome: str, max_tokens: int,
                 prompt_tokens: int) -> None:
        """Account one request (one choice of `n`) that ran (completed, cancelled or failed); `prompt_tokens`
        is 0 for the choices after the first, which share its prompt."""
        self.requests.labels(model, outcome).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(stats.output_tokens)
        if prompt_tokens:
            self.prompt_histogram.labels(model).observe(prompt_tokens)
        self.generation_histogram.labels(model).observe(stats.output_tokens)
        self.max_tokens.labels(model).observe(max_tokens)
        if stats.ttft_s is not None:
            self.ttft.labels(model).observe(stats.ttft_s)
        for before, after in zip(stats.token_times, stats.token_times[1:]):
            self.inter_token.labels(model).observe(after - before)
        if stats.total_s is not None:
            self.e2e.labels(model).observe(stats.total_s)
        if stats.scheduled_s is not None:
            self.queue.labels(model).observe(stats.scheduled_s)
            if stats.ttft_s is not None and stats.total_s is not None:
                self.prefill.labels(model).observe(stats.ttft_s - stats.scheduled_s)
                self.decode.labels(model).observe(stats.total_s - stats.ttft_s)
                if stats.output_tokens > 1:
                    self.request_per_output_token.labels(model).observe(
                        (stats.total_s - stats.ttft_s) / (stats.output_tokens - 1))
                self.inference.labels(model).observe(stats.total_s - stats.scheduled_s)
        if outcome == "completed":
            self.success.labels(model, finish_reason or "stop").inc()

    def rejected(self, model: str) -> None:
        self.requests.labels(model, "rejected").inc()
