"""The bidirectional Gemma3 encoder over one packed varlen batch.

Shapes: T packed tokens, B sequences, D hidden, H / Hkv heads, Dh head_dim, I intermediate.
The residual stream is threaded through the layers so that every residual add is fused with the post-norm before
it and the pre-norm after it; q/k/v and gate/up are joined into one GEMM each at load (egemma.engine.weights), and
both pre-norms' weights are folded into those GEMMs, so the pre-norms only compute each row's scale (rstd) and never
write their output. The qkv GEMM reads the residual stream itself and qk_norm_rope applies the scale: to v, and to
q and k, RMS-normalised per head there anyway, as their norms' eps / rstd^2. `mlp_up` may apply its row scale in
the gate_up GEMM's epilogue, with gelu_and_mul. Then the Head: mean pooling and the Dense chain, in fp32."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from egemma.engine import weights
from egemma.engine.config import ModelConfig
from egemma.kernels import native
from egemma.engine.select import Ops


@dataclass
class Packed:
    """Varlen batch metadata, built once per forward and read by every layer."""
    ids: torch.Tensor  # [T] int64
    pos: torch.Tensor  # [T] int64, position inside its own sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32 (CUDA graphs: more entries, see egemma.engine.graphs)
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
    qkv: torch.Tensor  # [(H + 2 Hkv) Dh, D], input_layernorm's (1 + w) folded in
    o: torch.Tensor  # [D, H Dh]
    gate_up: torch.Tensor  # [2I, D], gate and up rows interleaved, pre_feedforward_layernorm's (1 + w) folded in
    down: torch.Tensor  # [D, I]
    q_norm: torch.Tensor  # [Dh]
    k_norm: torch.Tensor
    post_attn_norm: torch.Tensor  # [D] each
    post_ff_norm: torch.Tensor
    sliding: bool


class Head:
    """The sentence-transformers modules after the encoder: mean pooling per sequence and the Dense projector
    (768 -> 3072 -> 768 for EmbeddingGemma), in fp32 whatever the encoder's dtype. L2 normalisation follows on the
    host (egemma.engine.Engine.embed), after the windows of a long text are combined (egemma.engine.windows)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        # The Dense layers have no activation (egemma.engine.config refuses any other): their chain is one affine map,
        # multiplied out at load in fp64. EmbeddingGemma's 768 -> 3072 -> 768 becomes one 768 x 768 GEMM, 8x fewer
        # FLOPs and weight bytes, the same function to fp32 rounding.
        w = b = None  # [out, in], [out] fp64
        for d in cfg.dense:
            path = d.path / "model.safetensors"
            t = weights.read_safetensors(path, prefixes=("",))
            want = {"linear.weight": (d.out_features, d.in_features)}
            if d.bias:
                want["linear.bias"] = (d.out_features,)
            weights.check(path, t, want)
            wd = t["linear.weight"].double()
            bd = t["linear.bias"].double() if d.bias else None
            b = bd if b is None else b @ wd.T + (0.0 if bd is None else bd)
            w = wd if w is None else wd @ w
        self.dense = (None if w is None else w.float().to(device), None if b is None else b.float().to(device))
        self.rows = 0  # > 0: the Dense GEMM always on this many rows (zeros past n), so no row's bits follow n

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor, n: int, ops: Ops) -> torch.Tensor:
        """x [T, D] -> fp32 [n, out_dim]: the mean over each of the first n sequences' rows (rows past
        cu_seqlens[n], graph padding that may never have been written, are not read), then Dense."""
        e = ops.mean_pool(x, cu_seqlens, n)
        if self.dense[0] is not None:
            e = F.linear(F.pad(e, (0, 0, 0, self.rows - n)) if n < self.rows else e, *self.dense)[:n]
        return e


class Encoder:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        # each weight of every layer is a view of one [layers, ...] tensor: the layer-stack kernel reads them all
        # through one pointer (egemma/kernels/layer_stack.py)
        g, self.stacked = weights.load(cfg, self.device, dtype)
        self.embed, self.final_norm = g["embed"], g["final_norm"]  # [V, D], [D]
        self.embed_scale = torch.tensor(cfg.hidden ** 0.5, dtype=dtype)  # rounded to dtype, as transformers does
        self.layers = [Layer(**{k: t[i] for k, t in self.stacked.items()}, sliding=s)
                       for i, s in enumerate(cfg.sliding)]
        self.sliding = torch.tensor(cfg.sliding, dtype=torch.int32, device=self.device)
        # RoPE tables stay fp32 whatever the dtype: the fused kernel rotates in fp32. One tensor, [local cos, local
        # sin, global cos, global sin], as the layer-stack kernel reads them; the layered forward takes views.
        self.stack_rope = torch.stack([t for s in (True, False) for t in native.rope_table(
            cfg.rope_base_local if s else cfg.rope_base_global, cfg.head_dim, cfg.max_positions, self.device)])
        self.rope = {True: (self.stack_rope[0], self.stack_rope[1]), False: (self.stack_rope[2], self.stack_rope[3])}
        self.head = Head(cfg, self.device)

    def weight_bytes(self) -> int:
        """Bytes of the weights held on the device (the per-instance memory budget)."""
        ts = [self.embed, self.final_norm, *self.stacked.values(), *(t for t in self.head.dense if t is not None)]
        return sum(t.numel() * t.element_size() for t in ts)

    def forward(self, b: Packed, ops: Ops, attn: tuple[Callable, Callable]) -> torch.Tensor:
        """Final-normed hidden states [T, D]. attn: (sliding-layer attention, global-layer attention)."""
        c = self.cfg
        h, rstd = ops.embed(b.ids, self.embed, self.embed_scale, c.eps)  # residual stream [T, D], [T]
        for i, L in enumerate(self.layers):
            cos, sin = self.rope[L.sliding]
            q, k, v = ops.qk_norm_rope(h @ L.qkv.T, b.pos, L.q_norm, L.k_norm, cos, sin, c.heads, c.kv_heads, c.eps,
                                       rstd)
            a = attn[0 if L.sliding else 1](q, k, v, b.cu_seqlens, b.max_seqlen,
                                             c.window if L.sliding else -1, c.attn_scale)  # [T, H, Dh]
            y = ops.mlp_up(a.reshape(a.shape[0], -1) @ L.o.T, h, L.post_attn_norm, L.gate_up, c.eps)  # [T, I]
            d = y @ L.down.T  # [T, D]
            if i + 1 < len(self.layers):
                rstd = ops.norm_add_rstd(d, h, L.post_ff_norm, c.eps)
        return ops.norm_add_norm(d, h, self.layers[-1].post_ff_norm, self.final_norm, c.eps)  # pooling reads it

    def forward_stack(self, b: Packed, ops: Ops, **kw) -> torch.Tensor:
        """forward(b) with the layer stack as one kernel (egemma/kernels/layer_stack.py, at most its MAX_TOKENS
        tokens; kw: its layers()' sync and times)."""
        from egemma.kernels import layer_stack
        c = self.cfg
        h, _ = ops.embed(b.ids, self.embed, self.embed_scale, c.eps)  # the kernel works out the row scales itself
        return layer_stack.layers(h, {**self.stacked, "final_norm": self.final_norm}, self.stack_rope, self.sliding,
                                  b.pos, b.cu_seqlens, heads=c.heads, kv_heads=c.kv_heads, eps=c.eps,
                                  scale=c.attn_scale, window=c.window, **kw)

    def embed_packed(self, b: Packed, n: int, ops: Ops, attn: tuple[Callable, Callable],
                     stack: bool = False) -> torch.Tensor:
        """fp32 embeddings [n, out_dim] of the first n sequences of b; stack: the layers as one kernel."""
        return self.head(self.forward_stack(b, ops) if stack else self.forward(b, ops, attn), b.cu_seqlens, n, ops)
