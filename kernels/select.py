"""Backend choice, made once at load and logged. Elementwise ops: sgl-kernel > Triton-lang > torch-native.
Attention: FA3 (flash_attn_interface) / torch's built-in FA2 / native SDPA; the engine times the candidates
per token bucket and layer type and keeps the fastest. Every choice computes the same function as
`kernels.native` up to bf16 rounding; asking for a backend that is not installed is an error, never a
silent fallback."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from kernels import native

NORM_BACKENDS = ("sgl-kernel", "triton", "native")
ATTENTION_BACKENDS = ("fa3", "fa2", "native")


@dataclass(frozen=True)
class Ops:
    name: str
    rmsnorm: Callable  # (x, w, eps) -> out
    norm_add_norm: Callable  # (x, residual, w_post, w_pre, eps) -> out; residual updated in place
    gelu_tanh_and_mul: Callable  # (gate_up) -> out
    qk_norm_rope: Callable  # (qkv, pos, q_w, k_w, cos, sin, heads, kv_heads, eps) -> q, k, v


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def available_norm_backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["native"]
    return [b for b, ok in (("sgl-kernel", _have("sgl_kernel")), ("triton", _have("triton")), ("native", True)) if ok]


def available_attention_backends(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return ["native"]
    out = ["fa3"] if _have("flash_attn_interface") and torch.cuda.get_device_capability(device)[0] == 9 else []
    if torch.cuda.get_device_capability(device)[0] >= 8:
        out.append("fa2")
    return out + ["native"]


def make_ops(backend: str, device: torch.device) -> Ops:
    """backend: 'auto' or one of NORM_BACKENDS."""
    have = available_norm_backends(device)
    if backend == "auto":
        backend = have[0]
    if backend not in have:
        raise RuntimeError(f"norm backend {backend!r} is not available on {device} (available: {have})")
    qk = native.qk_norm_rope
    if device.type == "cuda" and _have("triton"):
        from kernels import triton_ops
        qk = triton_ops.qk_norm_rope
    if backend == "native":
        return Ops("native", native.rmsnorm, native.norm_add_norm, native.gelu_tanh_and_mul, qk)
    if backend == "triton":
        from kernels import triton_ops as t
        return Ops("triton", t.rmsnorm, t.norm_add_norm, t.gelu_tanh_and_mul, qk)
    import sgl_kernel

    def rmsnorm(x, w, eps):
        return sgl_kernel.gemma_rmsnorm(x, w, eps)

    def norm_add_norm(x, residual, w_post, w_pre, eps):
        y = sgl_kernel.gemma_rmsnorm(x, w_post, eps)
        sgl_kernel.gemma_fused_add_rmsnorm(y, residual, w_pre, eps)
        return y

    def gelu_tanh_and_mul(gate_up):
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)
        sgl_kernel.gelu_tanh_and_mul(gate_up, out)
        return out

    return Ops("sgl-kernel", rmsnorm, norm_add_norm, gelu_tanh_and_mul, qk)


def attention_fn(backend: str) -> Callable:
    """(q [T,H,Dh], k [T,Hkv,Dh], v, cu_seqlens int32 [B+1], max_seqlen, window (-1: none), scale) -> [T,H,Dh]."""
    if backend == "native":
        return native.attention
    if backend == "fa3":
        from flash_attn_interface import flash_attn_varlen_func

        def fa3(q, k, v, cu, max_seqlen, window, scale):
            out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale,
                                         causal=False, window_size=(window, window))
            return out[0] if isinstance(out, tuple) else out
        return fa3
    if backend == "fa2":
        def fa2(q, k, v, cu, max_seqlen, window, scale):
            w = window if window >= 0 else None
            return torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, False, False, scale=scale,
                window_size_left=w, window_size_right=w)[0]
        return fa2
    raise ValueError(f"unknown attention backend {backend!r} (choose from {ATTENTION_BACKENDS})")
