"""Every Gemma3 weight the encoder loads, in one table: its shape from the config and the fused tensor it joins.
The table drives strict loading (a missing, unexpected or mis-shaped weight fails naming it), fusing at load
(q/k/v -> qkv, gate/up -> gate_up: one GEMM each; the pre-attention and pre-MLP norms' weights folded into qkv and
gate_up, FOLDED) and the test checkpoint generator."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from egemma.engine.config import CheckpointError, ModelConfig

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
# (kernels/fused_gemm.py); every gelu_and_mul reads that order.
INTERLEAVED = {"gate_up"}
# Norms whose (1 + w) is multiplied into the columns of the GEMM they feed, at load in fp32: the norm then only
# scales each row and its output is never written. gate_up's epilogue takes the row scale (egemma.kernels.select,
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


def load(c: ModelConfig, device, dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(global fields, layer fields each stacked [layers, ...]) as the model holds them: checked against the table,
    fused, on device. The layers are stacked on the host, so the device never holds a weight twice."""
    path = c.path / "model.safetensors"
    w = read_safetensors(path)
    check(path, w, expected(c))
    per_layer = [_fields(w, LAYER, f"layers.{i}.", dtype) for i in range(c.layers)]
    stacked = {k: torch.stack([f.pop(k) for f in per_layer]).to(device) for k in list(per_layer[0])}
    return {k: v.to(device) for k, v in _fields(w, GLOBAL, "", dtype).items()}, stacked
