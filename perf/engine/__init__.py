"""Benchmarks of the engine and its kernels in one process, no server: forward times, kernel choices, memory,
determinism."""
