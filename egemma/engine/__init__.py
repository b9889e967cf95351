"""The engine: a checkpoint's config and weights, the packed varlen Gemma3 encoder, its CUDA graphs and the
tokenizer. It imports nothing from egemma.serving or egemma.ops, so it runs and is tested without Triton."""

import os

__all__ = ["Engine", "EngineConfig"]

# cuBLAS without a workspace of its own: its Hopper GEMMs then take their static-schedule variants, which need no
# memset before each launch. In a CUDA graph each memset left the GPU idle ~4 us before its GEMM, 72 times a forward
# of 16k tokens, and the variants ran faster besides (perf/RESULTS.md runs 80-82). torch reads this once, at its first
# cuBLAS call, so it is set on importing the engine; a value set by the user stands (the engine logs it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")


def __getattr__(name):  # lazily: egemma.engine.config alone (the HTTP gateway reads it) must not import torch
    if name in __all__:
        from egemma.engine import engine
        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
