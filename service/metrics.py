"""Every metric the service exports, in one place. Names start with `longdoc_`, durations end in
`_seconds`; length buckets come from the configured models (block size up to max length).

Each `Metrics` owns its own CollectorRegistry, so several apps (tests) can live in one process.
With `PROMETHEUS_MULTIPROC_DIR` set (several server processes), values go to that directory and
`/metrics` aggregates every process through prometheus-client's MultiProcessCollector; gauges
then sum over live processes, except `longdoc_ready`, the minimum (a pod is ready when all are).

`longdoc_ready` mirrors `/readyz`: the app hands its readiness check to `track_readiness`, the
gauge is refreshed on every change the service knows of (start, drain, worker restart) and again
before every scrape, so it is never staler than the scrape that reads it.
"""

from __future__ import annotations

import os
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

# No `*_created` series (a creation timestamp beside every counter and histogram child: half of
# /metrics, and no dashboard or alert reads them), as most exporters do. Process-wide in
# prometheus-client; this module is the process's only exporter.
disable_created_metrics()

FAILURE_REASONS = ("validation", "too_large", "overloaded", "timeout", "cancelled", "unavailable", "internal")
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def length_buckets(max_length: int, block_size: int) -> tuple[int, ...]:
    """Upper bounds for the length-bucket label: block_size doubling up to max_length."""
    bounds, b = [], max(1, block_size)
    while b < max_length:
        bounds.append(b)
        b *= 2
    bounds.append(max_length)
    return tuple(bounds)


def length_label(n_tokens: int, bounds: tuple[int, ...]) -> str:
    for b in bounds:
        if n_tokens <= b:
            return f"le_{b}"
    return f"gt_{bounds[-1]}"


class Metrics:
    def __init__(self, max_batch_tokens: int = 16384, max_batch_size: int = 32):
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        r = self.registry = CollectorRegistry()
        stage = ("model", "endpoint", "length_bucket")
        gauge_mode = {"multiprocess_mode": "livesum"} if self.multiprocess else {}
        self.request_seconds = Histogram(
            "longdoc_request_duration_seconds", "Whole request, received to answered.", stage,
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.tokenize_seconds = Histogram(
            "longdoc_tokenize_duration_seconds", "Tokenization and windowing.", stage,
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.queue_seconds = Histogram(
            "longdoc_queue_duration_seconds", "Waiting in the batcher queue (first window).", stage,
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.inference_seconds = Histogram(
            "longdoc_inference_duration_seconds", "Worker time attributed to the request.", stage,
            buckets=DURATION_BUCKETS, registry=r,
        )
        size_buckets = sorted({1, 2, 4, 8, 16, 32, 64, 128, max_batch_size})
        self.time_to_first_token_seconds = Histogram(
            "longdoc_time_to_first_token_seconds", "A streamed summary: received to its first token event sent "
            "(tokenization, queue, encoder and the first decoder step; a beam search: all of it).",
            ("model", "length_bucket"), buckets=DURATION_BUCKETS, registry=r,
        )
        self.batch_size = Histogram(
            "longdoc_batch_size", "Sequences per batch run (summarize: per decoder step).", ("model",), buckets=size_buckets, registry=r
        )
        tok_buckets = sorted({max_batch_tokens // 2**k for k in range(8) if max_batch_tokens // 2**k > 0})
        self.batch_tokens = Histogram(
            "longdoc_batch_tokens", "Padded tokens per batch run.", ("model",), buckets=tok_buckets, registry=r
        )
        self.padding_waste = Histogram(
            "longdoc_padding_waste_ratio", "Share of a batch's padded tokens that are padding.", ("model",),
            buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0), registry=r,
        )
        self.queue_requests = Gauge(
            "longdoc_queue_depth_requests", "Sequences waiting in the queue.", ("model",), registry=r, **gauge_mode
        )
        self.queue_tokens = Gauge(
            "longdoc_queue_depth_tokens", "Tokens waiting in the queue.", ("model",), registry=r, **gauge_mode
        )
        self.in_flight = Gauge(
            "longdoc_in_flight_requests", "Requests being served.", ("endpoint",), registry=r, **gauge_mode
        )
        self.windows = Histogram(
            "longdoc_windows_per_request", "Windows a request's documents were split into.", ("model", "endpoint"),
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128), registry=r,
        )
        self.generated_tokens = Counter(
            "longdoc_generated_tokens", "Tokens generated by summarization.", ("model",), registry=r
        )
        self.failures = Counter(
            "longdoc_request_failures", "Failed requests by reason.", ("endpoint", "reason"), registry=r
        )
        self.worker_restarts = Counter(
            "longdoc_worker_restarts", "Workers restarted after a failure.", ("model",), registry=r
        )
        self.input_tokens = Counter(
            "longdoc_input_tokens", "Real (unpadded) input tokens run through the encoder, counted per batch "
            "run (windows, question and special tokens included; padding not).", ("model", "endpoint"), registry=r
        )
        self.ready = Gauge(
            "longdoc_ready", "1 when /readyz answers 200 (models loaded and warmed up, every worker healthy, "
            "not draining), else 0.", registry=r, **({"multiprocess_mode": "livemin"} if self.multiprocess else {})
        )
        self._is_ready: Callable[[], bool] = lambda: False
        self.ready.set(0)
        for reason in FAILURE_REASONS:  # export zeros so dashboards see every series
            for endpoint in ("qa", "summarize", "classify", "embeddings", "embed"):
                self.failures.labels(endpoint, reason)

    def track_readiness(self, is_ready: Callable[[], bool]) -> None:
        """`is_ready` is what /readyz answers by; `longdoc_ready` follows it from now on."""
        self._is_ready = is_ready
        self.refresh_ready()

    def refresh_ready(self) -> None:
        self.ready.set(1 if self._is_ready() else 0)

    def render(self) -> tuple[bytes, str]:
        self.refresh_ready()
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
