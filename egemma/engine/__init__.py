"""The engine: a checkpoint's config and weights, the packed varlen Gemma3 encoder, its CUDA graphs and the
tokenizer. It imports nothing from egemma.serving or egemma.ops, so it runs and is tested without Triton."""
from egemma.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
