"""The benchmarks, by job: `engine` (the engine and its kernels, no server), `serving` (our server end to end),
`peers` (ours beside sentence-transformers, Infinity and vLLM), `lib` (what they share: the texts, the one server
helper, the one load driver, perf_analyzer and Triton's accounting, the host monitor). Run from the repository root
as modules, e.g. `python -m perf.serving.bench_serve CHECKPOINT --out DIR`; the figures are in perf/RESULTS.md."""
