"""Prometheus metrics of the server, named after vLLM's (`vllm:` → `cann_llm:`) where they match."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
OUTCOMES = ("completed", "rejected", "cancelled", "failed")


class ServerMetrics:
    """One registry per server; engine-side gauges are read when scraped."""

    def __init__(self, engines: dict):
        self.registry = CollectorRegistry()
        # Prometheus' standard process metrics, as vLLM's default registry has them: process_resident_memory_bytes,
        # process_cpu_seconds_total, open file descriptors
        ProcessCollector(registry=self.registry)
        label = ["model_name"]
        self.ttft = Histogram("cann_llm:time_to_first_token_seconds", "Time to first token", label,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("cann_llm:inter_token_latency_seconds", "Time between output tokens", label,
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("cann_llm:e2e_request_latency_seconds", "Request latency, end to end", label,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("cann_llm:requests", "Requests by outcome (completed, rejected, cancelled, failed)",
                                label + ["outcome"], registry=self.registry)
        self.success = Counter("cann_llm:request_success", "Completed requests by finish reason",
                               label + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("cann_llm:prompt_tokens", "Prompt tokens", label, registry=self.registry)
        self.generation_tokens = Counter("cann_llm:generation_tokens", "Generated tokens", label, registry=self.registry)
        gauges = {
            "num_requests_running": ("Sequences in the running batch", lambda e: len(e.scheduler.running)),
            "num_requests_waiting": ("Sequences waiting to be scheduled", lambda e: len(e.scheduler.waiting)),
            "kv_cache_usage_perc": ("Fraction of KV pages owned by sequences (0-1)",
                                    lambda e: e.blocks.num_used / e.blocks.num_pages),
            "prefix_cache_queries": ("Full prompt pages looked up in the prefix cache", lambda e: e.blocks.prefix_queries),
            "prefix_cache_hits": ("Prompt pages found in the prefix cache", lambda e: e.blocks.prefix_hits),
            "num_preemptions": ("Sequences preempted by recompute", lambda e: e.stats.preemptions),
            "spec_decode_num_draft_tokens": ("Draft tokens proposed by prompt lookup", lambda e: e.stats.draft_tokens),
            "spec_decode_num_accepted_tokens": ("Draft tokens the model agreed with", lambda e: e.stats.accepted_tokens),
        }
        for name, (text, read) in gauges.items():
            gauge = Gauge(f"cann_llm:{name}", text, label, registry=self.registry)
            for model, engine in engines.items():
                gauge.labels(model).set_function(lambda engine=engine, read=read: read(engine))
        for model in engines:
            for outcome in OUTCOMES:
                self.requests.labels(model, outcome)

    def finished(self, model: str, stats, finish_reason: str | None, outcome: str) -> None:
        """Account one request that ran (completed, cancelled or failed)."""
        self.requests.labels(model, outcome).inc()
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.generation_tokens.labels(model).inc(stats.output_tokens)
        if stats.ttft_s is not None:
            self.ttft.labels(model).observe(stats.ttft_s)
        for before, after in zip(stats.token_times, stats.token_times[1:]):
            self.inter_token.labels(model).observe(after - before)
        if stats.total_s is not None:
            self.e2e.labels(model).observe(stats.total_s)
        if outcome == "completed":
            self.success.labels(model, finish_reason or "stop").inc()

    def rejected(self, model: str) -> None:
        self.requests.labels(model, "rejected").inc()
