"""Request latencies on the OpenAI server's own ``/metrics``: TTFT, inter-token latency, end to end.

Triton's metrics port counts steps and tokens; how long a client waited is seen only
where the client is, so these are measured here, as vLLM measures them in its
frontend. Each app gets its own registry, so several apps in one process (the tests)
do not collide.

Inter-token latency is per token: a response that brings ``n`` tokens ``t`` seconds
after the previous one is observed ``n`` times as ``t / n`` (a speculative step brings
several tokens at once), so the histogram's sum over its count is the mean time per
output token after the first response, the figure aiperf calls ITL.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram

# vLLM's bucket edges, with finer low ends: a small model on a GPU answers in milliseconds
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0)  # fmt: skip
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
               240.0, 480.0, 960.0)  # fmt: skip
PREFIX = "specdec_openai_"


class LatencyMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        labels = ("model",)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Request arrival to the first response with text",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)  # fmt: skip
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time per output token after the first response",
                             labels, buckets=ITL_BUCKETS, registry=self.registry)  # fmt: skip
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request arrival to its last token",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)  # fmt: skip
        self.finished = Counter(f"{PREFIX}request_success", "Requests that ran to the end, by finish reason",
                                ("model", "finish_reason"), registry=self.registry)  # fmt: skip

    def timer(self, model: str) -> RequestTimer:
        return RequestTimer(self, model)


class RequestTimer:
    """One request's clock: started when the request arrives, fed each response's token count."""

    def __init__(self, metrics: LatencyMetrics, model: str):
        self.metrics, self.model = metrics, model
        self.started = self._last = time.perf_counter()
        self._tokens = 0

    def on_response(self, num_output_tokens: int) -> None:
        """A response arrived; ``num_output_tokens`` is the request's count so far."""
        now = time.perf_counter()
        new = num_output_tokens - self._tokens
        if self._tokens == 0:
            self.metrics.ttft.labels(self.model).observe(now - self.started)
        elif new > 0:
            itl = self.metrics.itl.labels(self.model)
            for _ in range(new):
                itl.observe((now - self._last) / new)
        self._tokens, self._last = max(num_output_tokens, self._tokens), now

    def finish(self, finish_reason: str) -> None:
        self.metrics.e2e.labels(self.model).observe(time.perf_counter() - self.started)
        self.metrics.finished.labels(self.model, finish_reason).inc()
