"""The bidirectional Gemma3 encoder over one packed varlen batch, plus pooling and the Dense projector.

Shapes: T packed tokens, B sequences, D hidden, H / Hkv heads, Dh head_dim, I intermediate.
The residual stream is threaded through the layers so that every residual add is fused with the post-norm before
it and the pre-norm after it (`norm_add_norm`); q/k/v and gate/up are joined into one GEMM each at load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open

from egemma.engine.config import CheckpointError, ModelConfig
from egemma.kernels import native
from egemma.kernels.select import Ops


@dataclass
class Packed:
    """Varlen batch metadata, built once per forward and read by every layer."""
    ids: torch.Tensor  # [T] int64
    pos: torch.Tensor  # [T] int64, position inside its own sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32 (CUDA graphs: more entries, see egemma.graphs)
    max_seqlen: int

    @classmethod
    def from_lengths(cls, ids: torch.Tensor, lengths: list[int], device) -> "Packed":
        lens = torch.tensor(lengths, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=cu[1:])
        pos = torch.arange(int(lens.sum())) - torch.repeat_interleave(cu[:-1].long(), lens)
        return cls(ids.to(device), pos.to(device), cu.to(device), int(max(lengths, default=0)))


@dataclass
class Layer:
    qkv: torch.Tensor  # [(H + 2 Hkv) Dh, D]
    o: torch.Tensor  # [D, H Dh]
    gate_up: torch.Tensor  # [2I, D]
    down: torch.Tensor  # [D, I]
    q_norm: torch.Tensor  # [Dh]
    k_norm: torch.Tensor
    input_norm: torch.Tensor  # [D] each
    post_attn_norm: torch.Tensor
    pre_ff_norm: torch.Tensor
    post_ff_norm: torch.Tensor
    sliding: bool


def _layer_names(i: int) -> dict[str, str]:
    p = f"layers.{i}."
    return {n: p + n + ".weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")}


def _read_safetensors(path, prefixes=("", "model.")) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"missing weights file {path}")
    with safe_open(str(path), "pt") as f:
        keys = list(f.keys())
        prefix = next((p for p in prefixes if any(k.startswith(p + "layers.") or k == p + "embed_tokens.weight"
                                                  for k in keys)), "")
        return {k[len(prefix):] if k.startswith(prefix) else k: f.get_tensor(k) for k in keys}


class Encoder:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        c = cfg
        w = _read_safetensors(c.path / "model.safetensors")
        expected = {"embed_tokens.weight": (c.vocab_size, c.hidden), "norm.weight": (c.hidden,)}
        for i in range(c.layers):
            n = _layer_names(i)
            expected.update({
                n["self_attn.q_proj"]: (c.heads * c.head_dim, c.hidden),
                n["self_attn.k_proj"]: (c.kv_heads * c.head_dim, c.hidden),
                n["self_attn.v_proj"]: (c.kv_heads * c.head_dim, c.hidden),
                n["self_attn.o_proj"]: (c.hidden, c.heads * c.head_dim),
                n["self_attn.q_norm"]: (c.head_dim,), n["self_attn.k_norm"]: (c.head_dim,),
                n["mlp.gate_proj"]: (c.intermediate, c.hidden), n["mlp.up_proj"]: (c.intermediate, c.hidden),
                n["mlp.down_proj"]: (c.hidden, c.intermediate),
                **{n[k]: (c.hidden,) for k in ("input_layernorm", "post_attention_layernorm",
                                                "pre_feedforward_layernorm", "post_feedforward_layernorm")}})
        _check(c.path / "model.safetensors", w, expected)

        def t(name):
            return w[name].to(device=self.device, dtype=dtype).contiguous()

        def cat(*names):
            return torch.cat([w[n] for n in names]).to(device=self.device, dtype=dtype).contiguous()

        self.embed = t("embed_tokens.weight")  # [V, D]
        self.embed_scale = torch.tensor(c.hidden ** 0.5, dtype=dtype)  # rounded to dtype, as transformers does
        self.final_norm = t("norm.weight")
        self.layers = []
        for i in range(c.layers):
            n = _layer_names(i)
            self.layers.append(Layer(
                qkv=cat(n["self_attn.q_proj"], n["self_attn.k_proj"], n["self_attn.v_proj"]),
                o=t(n["self_attn.o_proj"]), gate_up=cat(n["mlp.gate_proj"], n["mlp.up_proj"]),
                down=t(n["mlp.down_proj"]), q_norm=t(n["self_attn.q_norm"]), k_norm=t(n["self_attn.k_norm"]),
                input_norm=t(n["input_layernorm"]), post_attn_norm=t(n["post_attention_layernorm"]),
                pre_ff_norm=t(n["pre_feedforward_layernorm"]), post_ff_norm=t(n["post_feedforward_layernorm"]),
                sliding=c.sliding[i]))
        del w
        # RoPE tables stay fp32 whatever the dtype: the fused kernel rotates in fp32.
        self.rope = {s: native.rope_table(c.rope_base_local if s else c.rope_base_global, c.head_dim,
                                          c.max_positions, self.device) for s in (True, False)}
        # The Dense projector and pooling run in fp32 on every backend.
        self.dense = []
        for d in c.dense:
            dw = _read_safetensors(d.path / "model.safetensors", prefixes=("",))
            exp = {"linear.weight": (d.out_features, d.in_features)}
            if d.bias:
                exp["linear.bias"] = (d.out_features,)
            _check(d.path / "model.safetensors", dw, exp)
            self.dense.append((dw["linear.weight"].float().to(self.device),
                               dw["linear.bias"].float().to(self.device) if d.bias else None))

    def forward(self, b: Packed, ops: Ops, attn: tuple[Callable, Callable]) -> torch.Tensor:
        """Final-normed hidden states [T, D]. attn: (sliding-layer attention, global-layer attention)."""
        c = self.cfg
        h = F.embedding(b.ids, self.embed) * self.embed_scale  # residual stream [T, D]
        x = ops.rmsnorm(h, self.layers[0].input_norm, c.eps)
        for i, L in enumerate(self.layers):
            cos, sin = self.rope[L.sliding]
            q, k, v = ops.qk_norm_rope(x @ L.qkv.T, b.pos, L.q_norm, L.k_norm, cos, sin, c.heads, c.kv_heads, c.eps)
            a = attn[0 if L.sliding else 1](q, k, v, b.cu_seqlens, b.max_seqlen,
                                             c.window if L.sliding else -1, c.attn_scale)  # [T, H, Dh]
            x = ops.norm_add_norm(a.reshape(a.shape[0], -1) @ L.o.T, h, L.post_attn_norm, L.pre_ff_norm, c.eps)
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            x = ops.norm_add_norm(ops.gelu_tanh_and_mul(x @ L.gate_up.T) @ L.down.T, h, L.post_ff_norm, nxt, c.eps)
        return x

    def pool(self, x: torch.Tensor, cu_seqlens: torch.Tensor, n: int, ops: Ops) -> torch.Tensor:
        """Mean over each of the first n sequences' tokens, Dense modules, L2 norm; fp32 [n, out_dim]. Tokens past
        cu_seqlens[n] (graph padding, possibly never written) are not read."""
        e = ops.mean_pool(x, cu_seqlens, n)
        for w, bias in self.dense:
            e = F.linear(e, w, bias)
        return F.normalize(e, dim=-1) if self.cfg.normalize else e


def _check(path, weights: dict, expected: dict):
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing weights {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                              f"unexpected weights {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")
    for k, shape in expected.items():
        if tuple(weights[k].shape) != shape:
            raise CheckpointError(f"{path}: weight {k} has shape {tuple(weights[k].shape)}, expected {shape}")
