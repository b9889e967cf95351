"""Every Gemma3 weight the encoder loads, in one table: its shape from the config and the fused tensor it joins.
The table drives strict loading (a missing, unexpected or mis-shaped weight fails naming it), fusing at load
(q/k/v -> qkv, gate/up -> gate_up: one GEMM each; the pre-attention and pre-MLP norms' weights folded into qkv and
gate_up, FOLDED) and the test checkpoint generator.

The fused tensors, in the dtype served, are cached when $EGEMMA_CACHE_DIR is set (the launcher sets it: --cache-dir)
as one safetensors file per checkpoint and dtype, keyed by the checkpoint file's path, size and mtime and by this
module's source (the layout): a later load reads that (half the bytes in bf16, no fusing) straight onto the
device, and the first load of several instances at once builds it once (a lock; the others wait and read it). A
cache that cannot be written serves without it, a corrupt file is rebuilt, each with a warning."""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from egemma.engine import process
from egemma.engine.config import CheckpointError, ModelConfig
from egemma.engine.process import configured, unwritable

log = logging.getLogger("egemma")

Shape = Callable[[ModelConfig], tuple[int, ...]]
# Per layer: checkpoint name (after "layers.{i}.", before ".weight") -> (Layer field, shape). Names that share a
# field are concatenated along dim 0 in this order.
LAYER: dict[str, tuple[str, Shape]] = {
    "self_attn.q_proj": ("qkv", lambda c: (c.heads * c.head_dim, c.hidden)),
    "self_attn.k_proj": ("qkv", lambda c: (c.kv_heads * c.head_dim, c.hidden)),
    "self_attn.v_proj": ("qkv", lambda c: (c.kv_heads * c.head_dim, c.hidden)),
    "self_attn.o_proj": ("o", lambda c: (c.hidden, c.heads * c.head_dim)),
    "self_attn.q_norm": ("q_norm", lambda c: (c.head_dim,)),
    "self_attn.k_norm": ("k_norm", lambda c: (c.head_dim,)),
    "mlp.gate_proj": ("gate_up", lambda c: (c.intermediate, c.hidden)),
    "mlp.up_proj": ("gate_up", lambda c: (c.intermediate, c.hidden)),
    "mlp.down_proj": ("down", lambda c: (c.hidden, c.intermediate)),
    "input_layernorm": ("input_norm", lambda c: (c.hidden,)),
    "post_attention_layernorm": ("post_attn_norm", lambda c: (c.hidden,)),
    "pre_feedforward_layernorm": ("pre_ff_norm", lambda c: (c.hidden,)),
    "post_feedforward_layernorm": ("post_ff_norm", lambda c: (c.hidden,)),
}
# Fields whose parts are interleaved row by row instead, in the table's order: gate row j, then up row j (so gate
# before up above), so that the fused gate_up + gelu kernel finds each pair in adjacent accumulator columns
# (egemma/kernels/fused_gemm.py); every gelu_and_mul reads that order.
INTERLEAVED = {"gate_up"}
# Norms whose (1 + w) is multiplied into the columns of the GEMM they feed, at load in fp32: the norm then only
# scales each row and its output is never written. gate_up's epilogue takes the row scale (egemma.engine.select,
# mlp_up); qkv's needs none for q and k, which are RMS-normalised per head after it, and v takes it in qk_norm_rope.
FOLDED = {"input_norm": "qkv", "pre_ff_norm": "gate_up"}
GLOBAL: dict[str, tuple[str, Shape]] = {
    "embed_tokens": ("embed", lambda c: (c.vocab_size, c.hidden)),
    "norm": ("final_norm", lambda c: (c.hidden,)),
}


def expected(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{checkpoint weight name: shape} of a Gemma3 encoder, in the table's order."""
    out = {f"{n}.weight": shape(c) for n, (_, shape) in GLOBAL.items()}
    for i in range(c.layers):
        out.update({f"layers.{i}.{n}.weight": shape(c) for n, (_, shape) in LAYER.items()})
    return out


def read_safetensors(path: Path, prefixes=("", "model.")) -> dict[str, torch.Tensor]:
    """All tensors of a file, with the first of `prefixes` under which the Gemma3 weights sit stripped."""
    if not path.exists():
        raise CheckpointError(f"missing weights file {path}")
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        prefix = next((p for p in prefixes if any(k.startswith(p + "layers.") or k == p + "embed_tokens.weight"
                                                  for k in keys)), "")
        return {k[len(prefix):] if k.startswith(prefix) else k: f.get_tensor(k) for k in keys}


def check(path, weights: dict, want: dict[str, tuple[int, ...]]):
    missing = sorted(set(want) - set(weights))
    unexpected = sorted(set(weights) - set(want))
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing weights {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                              f"unexpected weights {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for k, shape in want.items():
        if tuple(weights[k].shape) != shape:
            raise CheckpointError(f"{path}: weight {k} has shape {tuple(weights[k].shape)}, expected {shape}")


def _fields(w: dict, table: dict, prefix: str, dtype) -> dict[str, torch.Tensor]:
    parts: dict[str, list] = {}
    for name, (field, _) in table.items():
        parts.setdefault(field, []).append(w.pop(f"{prefix}{name}.weight"))
    fields = {f: torch.stack(p, 1).flatten(0, 1) if f in INTERLEAVED else torch.cat(p) for f, p in parts.items()}
    for norm, gemm in FOLDED.items():  # on the host: fp32 copies on the GPU would stay in its allocator's cache
        if norm in fields:
            fields[gemm] = fields[gemm].float() * (1.0 + fields.pop(norm).float())
    return {k: v.to(dtype=dtype).contiguous() for k, v in fields.items()}


def fuse(c: ModelConfig, dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(global fields, layer fields each stacked [layers, ...]) on the host: read from the checkpoint, checked
    against the table, fused. Stacked on the host, so the device never holds a weight twice."""
    path = c.path / "model.safetensors"
    w = read_safetensors(path)
    check(path, w, expected(c))
    per_layer = [_fields(w, LAYER, f"layers.{i}.", dtype) for i in range(c.layers)]
    stacked = {k: torch.stack([f.pop(k) for f in per_layer]) for k in list(per_layer[0])}
    return _fields(w, GLOBAL, "", dtype), stacked


def cached_path(c: ModelConfig, dtype) -> Path | None:
    """Where the fused weights of this checkpoint in dtype are cached; None without $EGEMMA_CACHE_DIR."""
    if (root := configured()) is None:
        return None
    src = (c.path / "model.safetensors").resolve()
    if not src.is_file():
        return None  # fuse() says what is missing
    st = src.stat()
    layout = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}:{dtype}:{layout}".encode()).hexdigest()[:16]
    name = hashlib.sha256(str(src).encode()).hexdigest()[:16]
    return root / "weights" / f"{name}-{str(dtype).split('.')[-1]}-{key}.safetensors"


def _read_cached(p: Path, device, writable: bool):
    """The cached weights on device, or None (with a warning, the file removed when writable) if unreadable."""
    try:
        with safe_open(str(p), "pt", device=str(device)) as f:
            keys = list(f.keys())
            g = {k[2:]: f.get_tensor(k) for k in keys if k.startswith("g.")}
            stacked = {k[2:]: f.get_tensor(k) for k in keys if k.startswith("l.")}
        if not g or not stacked:
            raise ValueError("it holds no weights")
        return g, stacked
    except Exception as e:  # truncated, overwritten, another layout
        log.warning("egemma: the cached weights %s are unreadable (%s: %s); %s", p, type(e).__name__, e,
                    "rebuilding them" if writable else "reading the checkpoint")
        if writable:
            p.unlink(missing_ok=True)
        return None


@contextmanager
def _locked(p: Path):
    """One builder per cache file across the instances that load at once: the others wait, then read it."""
    with open(p.with_name(p.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _build_and_save(c: ModelConfig, dtype, p: Path):
    """fuse(), then the cache file written (atomically) and this checkpoint's stale ones removed; the source."""
    g, stacked = fuse(c, dtype)
    tmp = p.with_name(f"{p.name}.tmp{os.getpid()}")
    try:
        save_file({**{f"g.{k}": v for k, v in g.items()}, **{f"l.{k}": v for k, v in stacked.items()}}, str(tmp))
        os.replace(tmp, p)
    except OSError as e:  # full meanwhile: serve, uncached
        tmp.unlink(missing_ok=True)
        log.warning("egemma: cannot cache the fused weights at %s (%s); serving without the cache", p, e)
        return (g, stacked), "checkpoint"
    for old in p.parent.glob(f"{p.name.split('-')[0]}-*.safetensors"):
        if old != p:
            old.unlink(missing_ok=True)
    return (g, stacked), "checkpoint-cached"


def load(c: ModelConfig, device, dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(global fields, layer fields each stacked [layers, ...]) as the model holds them, on device: from the
    cache when it holds them (module docstring), else fused from the checkpoint (and cached)."""
    t0 = time.time()
    p = cached_path(c, dtype)
    got, source = None, "checkpoint"
    if p is not None and (why := unwritable(p.parent)):
        got = _read_cached(p, device, False) if p.exists() else None
        if got is None:
            log.warning("egemma: the cache directory cannot be written (%s): the weights are read from the "
                        "checkpoint on every start", why)
        source = "cache" if got else source
    elif p is not None:
        with _locked(p):
            got = _read_cached(p, device, True) if p.exists() else None
            source = "cache" if got else source
            if got is None:
                got, source = _build_and_save(c, dtype, p)
    g, stacked = got or fuse(c, dtype)
    g, stacked = {k: v.to(device) for k, v in g.items()}, {k: v.to(device) for k, v in stacked.items()}
    process.phase("weights", since=t0, source=source)
    return g, stacked
