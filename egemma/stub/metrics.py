"""Prometheus counters for the Python-backend models, on Triton's metrics port (pb_utils.MetricFamily).
Every metric call is a round trip from the stub to the Triton process (per execute it slowed a single query:
perf/RESULTS.md runs 6 and 11), so increments accumulate here and are flushed at most once per `period` seconds."""
from __future__ import annotations

import time


class Counters:
    def __init__(self, pb_utils, specs: dict[str, str], prefix: str = "egemma_", period: float = 1.0):
        # A Metric must not outlive its MetricFamily: keep both.
        self.families = {k: pb_utils.MetricFamily(name=f"{prefix}{k}_total", description=d,
                                                  kind=pb_utils.MetricFamily.COUNTER) for k, d in specs.items()}
        self.metrics = {k: f.Metric(labels={}) for k, f in self.families.items()}
        self.pending = dict.fromkeys(specs, 0.0)
        self.period, self.last = period, float("-inf")  # the first add flushes at once

    def add(self, **values: float):
        for k, v in values.items():
            self.pending[k] += v
        if time.monotonic() - self.last >= self.period:
            self.flush()

    def flush(self):
        for k, v in self.pending.items():
            if v:
                self.metrics[k].increment(v)
                self.pending[k] = 0.0
        self.last = time.monotonic()
