"""The engine: a checkpoint's config and weights, the packed varlen Gemma3 encoder, the choice of its kernels
(select, tuning), its CUDA graphs, the tokenizer, and the process's place on the host (process: cores, cache
directory, boot log). It imports nothing from egemma.stub, egemma.gateway or egemma.ops, so it runs and is tested
without Triton."""

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name):  # lazily: egemma.engine.config alone (the HTTP gateway reads it) must not import torch
    if name in __all__:
        from egemma.engine import config, engine
        return getattr(engine if name == "Engine" else config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
