"""What every benchmark shares: the texts (corpora), the server helper (servers), the load driver (loadgen),
perf_analyzer and Triton's accounting (pa), the host monitor (gpumon)."""
