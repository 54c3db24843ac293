"""What `accessory serve` reports about itself: Prometheus metrics at /metrics, and one log line per request.

Counted on the source rank as requests end (names as vLLM's, under `accessory_`): requests by finish reason, prompt
and generated tokens; histograms of time to first token, time between tokens, end-to-end latency and time waiting
for a row. Read when scraped: gauges of running and waiting requests and of the KV cache's use, and the engine's
counts of prompt tokens computed and copied from the prefix cache.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("accessory.requests")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


@dataclass
class Timing:
    """One request's clock (time.monotonic), kept by the service as its events arrive."""
    label: str  # the client's X-Request-Id, or the request's own id
    prompt_tokens: int
    rows: list = field(default_factory=list)  # its samples' scheduler Requests (they record when they joined)
    user: Optional[str] = None
    submitted: float = field(default_factory=time.monotonic)
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    generated: dict = field(default_factory=dict)  # sample id -> tokens generated so far

    @property
    def tokens(self) -> int:
        return sum(self.generated.values())

    @property
    def admitted(self) -> Optional[float]:
        """When its first sample joined the batch."""
        return min((r.admitted_at for r in self.rows if r.admitted_at is not None), default=None)


class Metrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int], cache_usage: Callable[[], float],
                 engine_stats):
        """`engine_stats`: the engine's EngineStats, read when scraped."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # the serve extra
        from prometheus_client.core import CounterMetricFamily

        self.registry = CollectorRegistry()
        counter = lambda name, doc, *labels: Counter(name, doc, labels, registry=self.registry)  # noqa: E731
        histogram = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets,  # noqa: E731
                                                         registry=self.registry)
        self.requests = counter("accessory_requests", "Requests ended, by finish reason (of the last sample)",
                                "finish_reason")
        self.prompt_tokens = counter("accessory_prompt_tokens", "Prompt tokens of the requests ended")
        self.generation_tokens = counter("accessory_generation_tokens", "Tokens generated, every sample")
        self.time_to_first_token = histogram("accessory_time_to_first_token_seconds",
                                             "From the request's arrival to its first token", LATENCY_BUCKETS)
        self.inter_token_latency = histogram("accessory_inter_token_latency_seconds",
                                             "Between a request's consecutive tokens", TOKEN_GAP_BUCKETS)
        self.e2e_latency = histogram("accessory_e2e_request_latency_seconds", "From arrival to the last event",
                                     LATENCY_BUCKETS)
        self.queue_time = histogram("accessory_request_queue_time_seconds", "From arrival to a row in the batch",
                                    LATENCY_BUCKETS)
        for name, doc, read in (
                ("accessory_num_requests_running", "Samples in the batch or waiting for a row", running),
                ("accessory_num_requests_waiting", "Samples waiting for a row", waiting),
                ("accessory_kv_cache_usage_perc", "Fraction of the KV cache's positions that running rows hold",
                 cache_usage)):
            Gauge(name, doc, registry=self.registry).set_function(read)

        class EngineCounters:  # the engine counts these itself; a scrape reads them
            def collect(self):
                for name, doc, value in (
                        ("accessory_prefill_computed_tokens", "Prompt tokens computed by prefill",
                         engine_stats.prefilled_tokens),
                        ("accessory_prefix_cache_hit_tokens", "Prompt tokens copied from the KV cache instead "
                         "(prefix caching)", engine_stats.reused_tokens),
                        ("accessory_spec_decode_num_draft_tokens", "Tokens proposed by speculative decoding",
                         engine_stats.proposed_tokens),
                        ("accessory_spec_decode_num_accepted_tokens", "Proposed tokens that were accepted",
                         engine_stats.accepted_tokens)):
                    yield CounterMetricFamily(name, doc, value=value)

        self.registry.register(EngineCounters())

    def progress(self, timing: Timing, sample_id, generated: int, now: float) -> None:
        """Sample `sample_id` has generated `generated` tokens by `now` (an event may bring several)."""
        new = generated - timing.generated.get(sample_id, 0)
        if new <= 0:
            return
        gap = 0.0 if timing.last_token is None else (now - timing.last_token) / new
        if timing.first_token is None:
            timing.first_token = now
            self.time_to_first_token.observe(now - timing.submitted)
            new -= 1  # the others came with it: no time between them
        for _ in range(new):  # the time since the last tokens, shared by those this event brought
            self.inter_token_latency.observe(gap)
        timing.generated[sample_id], timing.last_token = generated, now

    def ended(self, timing: Timing, finish_reason: str, now: float) -> None:
        """The request's last sample ended: count it, and log its line."""
        self.requests.labels(finish_reason).inc()
        self.prompt_tokens.inc(timing.prompt_tokens)
        self.generation_tokens.inc(timing.tokens)
        self.e2e_latency.observe(now - timing.submitted)
        queued = (timing.admitted or now) - timing.submitted
        self.queue_time.observe(queued)
        first = f"{timing.first_token - timing.submitted:.3f} s" if timing.first_token is not None else "-"
        proposed = sum(r.proposed_tokens for r in timing.rows)
        accepted = sum(r.accepted_tokens for r in timing.rows)
        log.info("request %s: %s, %d prompt + %d output tokens%s%s, queued %.3f s, first token %s, total %.3f s%s",
                 timing.label, finish_reason, timing.prompt_tokens, timing.tokens,
                 f" ({len(timing.rows)} samples)" if len(timing.rows) > 1 else "",
                 f", {accepted} of {proposed} proposed tokens accepted" if proposed else "", queued, first,
                 now - timing.submitted, f", user {timing.user!r}" if timing.user else "")
