"""The server's Prometheus metrics, named and bucketed as vLLM's (`vllm:` becomes `serveplan:`), so
dashboards and scrapers written for vLLM read them unchanged.

Latencies are the engine's view (from the request's arrival at the server to the step that
delivered its tokens); a client adds the network and HTTP time on top (`serveplan bench --url`
measures that side). ITL is per delivered chunk, as in `RequestMetrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.core import Request, SchedulerOutput, StepSample
from engine.core.metrics import RequestMetrics

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """One registry per server (tests run several in one process). Updated on the engine thread,
    read by the scraper on the event loop: prometheus_client's metrics are thread-safe."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        registry, labelnames = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labelnames, buckets=buckets, registry=registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames, registry=registry).labels(model_name)

        self.ttft = histogram("serveplan:time_to_first_token_seconds", "Arrival to first output token", TTFT_BUCKETS_S)
        self.itl = histogram("serveplan:inter_token_latency_seconds", "Gap between deliveries of output tokens",
                             ITL_BUCKETS_S)
        self.e2e = histogram("serveplan:e2e_request_latency_seconds", "Arrival to finish", E2E_BUCKETS_S)
        self.running = gauge("serveplan:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("serveplan:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_cache_usage = gauge("serveplan:kv_cache_usage_perc", "Share of KV blocks held by requests, 0-1")
        self.preemptions = counter("serveplan:num_preemptions", "Requests preempted (recomputed later)")
        self.prompt_tokens = counter("serveplan:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("serveplan:generation_tokens", "Output tokens of finished requests")
        self.prefix_cache_queries = counter("serveplan:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("serveplan:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.rejected = counter("serveplan:request_rejected", "Requests refused with 429 (waiting queue full)")
        self._finished = Counter("serveplan:request_success", "Finished requests by reason",
                                 ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def observe_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def observe_step(self, output: SchedulerOutput, sample: StepSample) -> None:
        self.observe_state(sample.num_running, sample.num_waiting, sample.kv_cache_usage)
        if output.preempted_request_ids:
            self.preemptions.inc(len(output.preempted_request_ids))

    def observe_finished(self, request: Request) -> None:
        self._finished.labels(self._model_name, request.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        self.generation_tokens.inc(request.num_output_tokens)
        if request.first_scheduled_time is not None:
            self.prefix_cache_queries.inc(request.num_prompt_tokens)
            self.prefix_cache_hits.inc(request.num_cached_tokens)
        if request.finish_reason == "abort" or request.first_token_time is None:
            return  # a client that left, or a shutdown: not a latency the server delivered
        m = RequestMetrics.from_request(request)
        self.ttft.observe(m.ttft_s)
        self.e2e.observe(m.e2e_s)
        for gap in m.itl_s:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
