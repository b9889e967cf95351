"""Backend choice, made once at load by timing and logged: all autotuning lives here, with one timer. Elementwise
ops: sgl-kernel / Triton-lang / torch-native, the fastest per op. Attention: FA3 (flash_attn_interface) / torch's
built-in FA2 / native SDPA, the fastest per CUDA graph and layer type. Every choice computes the same function as
`kernels.native` up to bf16 rounding; asking for a backend that is not installed is an error, never a silent
fallback."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from egemma.kernels import native

NORM_BACKENDS = ("sgl-kernel", "triton", "native")
ATTENTION_BACKENDS = ("fa3", "fa2", "native")


@dataclass(frozen=True)
class Ops:
    name: str
    rmsnorm: Callable  # (x, w, eps) -> out
    norm_add_norm: Callable  # (x, residual, w_post, w_pre, eps) -> out; residual updated in place
    gelu_tanh_and_mul: Callable  # (gate_up) -> out
    qk_norm_rope: Callable  # (qkv, pos, q_w, k_w, cos, sin, heads, kv_heads, eps) -> q, k, v
    mean_pool: Callable  # (x, cu_seqlens, n) -> fp32 [n, D]


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


def _backend_ops(backend: str) -> dict[str, Callable]:
    if backend == "native":
        return dict(rmsnorm=native.rmsnorm, norm_add_norm=native.norm_add_norm,
                    gelu_tanh_and_mul=native.gelu_tanh_and_mul)
    if backend == "triton":
        from egemma.kernels import triton_ops as t
        return dict(rmsnorm=t.rmsnorm, norm_add_norm=t.norm_add_norm, gelu_tanh_and_mul=t.gelu_tanh_and_mul)
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

    return dict(rmsnorm=rmsnorm, norm_add_norm=norm_add_norm, gelu_tanh_and_mul=gelu_tanh_and_mul)


def time_ms(fn, *args, reps: int = 5, inner: int = 5, capture: bool = True) -> float:
    """Median GPU time of one fn(*args) in ms, by CUDA events around replays of a graph of `inner` calls: the
    forward runs as graph replays, and eager timing would rank by launch overhead instead. capture=False times
    fn itself (something that replays a graph already)."""
    fn(*args)  # lazy initialisation and workspace allocation stay out of the graph
    if capture:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn(*args)
        run, per = g.replay, inner
    else:
        run, per = (lambda: fn(*args)), 1
    runs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / per)
    return sorted(runs)[len(runs) // 2]


def make_ops(backend: str, device: torch.device, dtype=torch.bfloat16, hidden=768, intermediate=1152,
             tokens=16384) -> Ops:
    """backend: one of NORM_BACKENDS for every op, or 'auto': on CUDA each op takes the fastest available
    backend, timed here on [tokens, hidden] data."""
    have = available_norm_backends(device)
    if backend != "auto" and backend not in have:
        raise RuntimeError(f"norm backend {backend!r} is not available on {device} (available: {have})")
    fused = dict(qk_norm_rope=native.qk_norm_rope, mean_pool=native.mean_pool)  # no library has these
    if device.type == "cuda" and _have("triton"):
        from egemma.kernels import triton_ops
        fused = dict(qk_norm_rope=triton_ops.qk_norm_rope, mean_pool=triton_ops.mean_pool)
    if backend != "auto" or len(have) == 1:
        name = have[0] if backend == "auto" else backend
        return Ops(name, **fused, **_backend_ops(name))
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    h = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(hidden, device=device, dtype=dtype)
    gu = torch.randn(tokens, 2 * intermediate, device=device, dtype=dtype)
    args = {"rmsnorm": (x, w, 1e-6), "norm_add_norm": (x, h, w, w, 1e-6), "gelu_tanh_and_mul": (gu,)}
    cands = {b: _backend_ops(b) for b in have}
    chosen, names = {}, []
    for op, a in args.items():
        times = {b: time_ms(cands[b][op], *a) for b in have}
        best = min(times, key=times.get)
        chosen[op] = cands[best][op]
        names.append(f"{op}={best}")
    return Ops(",".join(names), **fused, **chosen)


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


def pick_attention(cands: list[str], q, k, v, cu_seqlens, max_seqlen: int, window: int, scale: float) -> str:
    """The fastest of the candidate backends on these inputs. Time them on q / k / v exactly as the forward
    makes them (v a strided view of the qkv GEMM output): on other layouts the ranking came out differently."""
    if len(cands) == 1:
        return cands[0]
    times = {name: time_ms(attention_fn(name), q, k, v, cu_seqlens, max_seqlen, window, scale) for name in cands}
    return min(times, key=times.get)
