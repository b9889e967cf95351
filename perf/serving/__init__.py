"""Benchmarks of our server end to end (tritonserver, the gateway, the launcher): throughput, latency, boot, soak."""
