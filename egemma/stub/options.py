"""The stub's side of the request options (their vocabulary, parser and OPTIONS encoding: egemma.spec): the
dimensions a model config allows, and one request's output shaped by its options (Matryoshka, binary)."""
from __future__ import annotations

import numpy as np

from egemma.spec import MATRYOSHKA, OUTPUTS, OptionError, RequestOptions


def allowed_dimensions(spec: str, out_dim: int) -> tuple[int, ...]:
    """From a config parameter like "768,512,256,128"; empty: out_dim and the Matryoshka sizes below it."""
    dims = tuple(int(d) for d in spec.split(",") if d.strip()) if spec.strip() else \
        (out_dim, *(d for d in MATRYOSHKA if d < out_dim))
    if any(not 0 < d <= out_dim for d in dims):
        raise ValueError(f"matryoshka_dims {dims} must lie in [1, {out_dim}]")
    return dims


def check_dimensions(opts: RequestOptions, allowed: tuple[int, ...]):
    if opts.dimensions is not None and opts.dimensions not in allowed:
        raise OptionError(f"dimensions {opts.dimensions} is not supported; choose from {list(allowed)}")


def shape_output(emb: np.ndarray, opts: RequestOptions) -> tuple[str, np.ndarray]:
    """(output name, tensor) for one request's fp32 embeddings [n, D] (options already checked):
    truncate + renormalise, then quantize."""
    if opts.dimensions is not None and opts.dimensions != emb.shape[1]:
        emb = emb[:, :opts.dimensions]
        emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    if opts.encoding == "float":
        return OUTPUTS["float"], np.ascontiguousarray(emb, dtype=np.float32)
    bits = np.packbits(emb > 0, axis=-1)
    return OUTPUTS[opts.encoding], bits if opts.encoding == "ubinary" else (bits - 128).astype(np.int8)
