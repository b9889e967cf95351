"""The backends the engine chooses from, and the timer it chooses with (the choices themselves are made once, in
egemma.engine.tuning). Elementwise ops: sgl-kernel / Triton-lang / torch-native. The MLP's first half (mlp_up: the
norms around the residual add, the gate_up GEMM, gelu_and_mul): norm_add_norm + cuBLAS + gelu_and_mul, or a norm that
only computes each row's scale + one fused GEMM (kernels.fused_gemm) in one of its tiles. Attention: FA3
(flash_attn_interface) / torch's built-in FA2 / native SDPA. Every backend computes the same function as
`kernels.native` up to bf16 rounding; asking for a backend that is not installed is an error, never a silent
fallback."""
from __future__ import annotations

import bisect
import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from egemma.kernels import native


NORM_BACKENDS = ("sgl-kernel", "triton", "native")
ATTENTION_BACKENDS = ("fa3", "fa2", "native")


@dataclass(frozen=True)
class Ops:
    name: str
    embed: Callable  # (ids, table, scale, eps) -> residual [T, D], its rows' rstd fp32 [T]
    norm_add_norm: Callable  # (x, residual, w_post, w_pre, eps) -> out; residual updated in place
    norm_add_rstd: Callable  # (x, residual, w_post, eps) -> rstd fp32 [T]; residual updated in place
    gelu_tanh_and_mul: Callable  # (gate_up, gate and up columns interleaved) -> out
    mlp_up: Callable  # (x, residual, w_post, w_gate_up, eps) -> native.mlp_up: [T, I]; residual updated in place
    qk_norm_rope: Callable  # (qkv, pos, q_w, k_w, cos, sin, heads, kv_heads, eps, rstd) -> q, k, v
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
        return dict(norm_add_norm=native.norm_add_norm, gelu_tanh_and_mul=native.gelu_tanh_and_mul)
    if backend == "triton":
        from egemma.kernels import triton_ops as t
        return dict(norm_add_norm=t.norm_add_norm, gelu_tanh_and_mul=t.gelu_tanh_and_mul)
    import sgl_kernel

    def norm_add_norm(x, residual, w_post, w_pre, eps):
        y = sgl_kernel.gemma_rmsnorm(x, w_post, eps)
        sgl_kernel.gemma_fused_add_rmsnorm(y, residual, w_pre, eps)
        return y

    # no gelu_tanh_and_mul: sgl-kernel's reads [gate | up] halves, not the interleaved gate_up (egemma.engine.weights)
    return dict(norm_add_norm=norm_add_norm)


def compile_together(calls: list[Callable], device: torch.device):
    """Each call once, each on a thread of its own: the Triton-lang kernels they launch compile side by side (ptxas
    is a process of its own) instead of one after another when each is first timed. A call that fails here fails
    again where it is timed, which is where a failure is handled."""
    def one(call):
        torch.cuda.set_device(device)
        try:
            call()
        except Exception:  # noqa: BLE001 (see above)
            pass
    with ThreadPoolExecutor(max(1, len(calls))) as ex:
        list(ex.map(one, calls))
    torch.cuda.synchronize(device)


def time_ms(fn, *args, reps: int = 5, inner: int = 5, capture: bool = True, idle_s: float = 0.0) -> float:
    """Median GPU time of one fn(*args) in ms, by CUDA events around replays of a graph of `inner` calls: the
    forward runs as graph replays, and eager timing would rank by launch overhead instead. capture=False times
    fn itself (something that replays a graph already). idle_s: the GPU idles that long before each timed run (off
    its power cap: perf/engine/profile_engine.py's "rested")."""
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
        if idle_s:
            torch.cuda.synchronize()
            time.sleep(idle_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / per)
    return sorted(runs)[len(runs) // 2]


def time_layers(fn: Callable, layers: int, reps: int = 5) -> float:
    """Median GPU ms of one fn(i), i in range(layers), from one graph of all of them: each i reads its own weights or
    buffers, as the forward's layers do (one set would sit in L2 and flatter small sizes)."""
    def all_layers():
        for i in range(layers):
            fn(i)
    return time_ms(all_layers, reps=reps, inner=1) / layers


UNFUSED = "norm+cublas+gelu"


def _unfused(norm_add_norm: Callable, gelu: Callable, unit: torch.Tensor) -> Callable:
    """mlp_up as norm_add_norm (with a unit pre-norm weight, zeros of the model's width: its (1 + w) is folded into
    w_gate_up), cuBLAS, gelu."""
    return lambda x, residual, w_post, w, eps: gelu(norm_add_norm(x, residual, w_post, unit, eps) @ w.T)


def _fused(tile, norm_add_rstd: Callable) -> Callable:
    """mlp_up as a norm that writes only each row's scale, and the GEMM that applies it in its gelu epilogue: the
    normalised [T, D] activations are never written."""
    from egemma.kernels import fused_gemm

    def mlp_up(x, residual, w_post, w, eps):
        return fused_gemm.gate_up_gelu(residual, w, tile, norm_add_rstd(x, residual, w_post, eps))
    return mlp_up


def mlp_up_candidates(device, dtype, hidden: int, intermediate: int) -> list[str]:
    """mlp_up's paths here: UNFUSED, and the fused kernel's tiles (bf16 on Hopper, with rows TMA can load: 16-byte
    aligned; in fp32 Triton's dot would round to tf32)."""
    if dtype != torch.bfloat16 or device.type != "cuda" or not _have("triton"):
        return [UNFUSED]
    from egemma.kernels import fused_gemm
    if not (fused_gemm.supported(device) and fused_gemm.aligned(hidden, intermediate, dtype)):
        return [UNFUSED]
    return [UNFUSED] + [str(t) for t in fused_gemm.TILES]


def build_ops(norms: dict[str, str], mlp_up: list[str], device: torch.device, dtype=torch.bfloat16, hidden=768,
              buckets: list[int] | None = None, deterministic: bool = False) -> Ops:
    """Ops from named choices (egemma.engine.tuning makes them): norms {"norm_add_norm": backend,
    "gelu_tanh_and_mul": backend}; mlp_up a path per token bucket (UNFUSED or a fused tile's name; a batch takes
    the smallest bucket that holds it), or one path for all. deterministic: Triton-lang's row kernels with one launch
    shape whatever the batch, so a row's bits never depend on the batch it is in."""
    cands = {b: _backend_ops(b) for b in set(norms.values())}
    chosen = {op: cands[b][op] for op, b in norms.items()}
    own = native  # no library has these: Triton-lang's on CUDA
    if device.type == "cuda" and _have("triton"):
        from egemma.kernels import triton_ops as own
    fused = {op: getattr(own, op) for op in ("embed", "norm_add_rstd", "qk_norm_rope", "mean_pool")}
    if deterministic and own is not native:
        rows = own.DETERMINISTIC_ROW_WARPS
        fused = dict(embed=partial(own.embed, warps=rows), norm_add_rstd=partial(own.norm_add_rstd, warps=rows),
                     qk_norm_rope=partial(own.qk_norm_rope, warps=own.DETERMINISTIC_QK_WARPS),
                     mean_pool=partial(own.mean_pool, tile=own.DETERMINISTIC_POOL_TILE))
        if norms["norm_add_norm"] == "triton":
            chosen["norm_add_norm"] = partial(own.norm_add_norm, warps=rows)
    unit = torch.zeros(hidden, device=device, dtype=dtype)  # a norm weight w with (1 + w) = 1
    if set(mlp_up) - {UNFUSED}:
        from egemma.kernels import fused_gemm
        tiles = {str(t): t for t in fused_gemm.TILES}
    fns = [_unfused(chosen["norm_add_norm"], chosen["gelu_tanh_and_mul"], unit) if n == UNFUSED
           else _fused(tiles[n], fused["norm_add_rstd"]) for n in mlp_up]
    if len(set(mlp_up)) == 1:
        mlp = fns[0]
    else:
        bs = buckets or []

        def mlp(x, residual, w_post, w, eps):
            return fns[min(bisect.bisect_left(bs, x.shape[0]), len(bs) - 1)](x, residual, w_post, w, eps)
    runs = [(i, n) for i, n in enumerate(mlp_up) if i == 0 or n != mlp_up[i - 1]]
    how = ", ".join(f"{n} from {buckets[i]}" if buckets and len(runs) > 1 else n for i, n in runs)
    name = ",".join(f"{op}={b}" for op, b in norms.items()) + f",mlp_up=[{how}]"
    return Ops(name, **fused, **chosen, mlp_up=mlp)


def make_ops(backend: str, device: torch.device, dtype=torch.bfloat16, hidden=768,
             deterministic: bool = False) -> Ops:
    """Ops with one backend (one of NORM_BACKENDS) for every elementwise op (sgl-kernel: its norms, with Triton-lang's
    gelu_tanh_and_mul) and mlp_up unfused: for tests and benchmarks; the engine's own choice is timed
    (egemma.engine.tuning)."""
    have = available_norm_backends(device)
    if backend not in have:
        raise RuntimeError(f"norm backend {backend!r} is not available on {device} (available: {have})")
    gelu = "triton" if backend == "sgl-kernel" else backend
    return build_ops({"norm_add_norm": backend, "gelu_tanh_and_mul": gelu}, [UNFUSED], device, dtype, hidden,
                     deterministic=deterministic)


def attention_fn(backend: str) -> Callable:
    """(q [T,H,Dh], k [T,Hkv,Dh], v, cu_seqlens int32 [B+1], max_seqlen, window (-1: none), scale) -> [T,H,Dh]."""
    if backend == "native":
        return native.attention
    if backend == "fa3":
        from flash_attn_interface import flash_attn_varlen_func

        def fa3(q, k, v, cu, max_seqlen, window, scale):
            # pack_gqa=False: its default for varlen packs the 3 q heads a k head into one tile, 2-6% slower here
            # (8 x 2048 on the H200: 61.9 against 63.1 us a sliding layer, 147 against 151 a global one)
            out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, softmax_scale=scale,
                                         causal=False, window_size=(window, window), pack_gqa=False)
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
