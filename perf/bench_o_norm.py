"""A candidate for issue #14, measured here before it is wired into the engine: the o GEMM with the post-attention
norm, the residual add and the next norm's row scale in its epilogue, as one kernel for what the forward runs as
cuBLAS o + triton_ops.norm_add_rstd (perf/RESULTS.md "Targets (issue #14)"). A program owns BM whole 768-wide rows,
one 256-column part at a time (three accumulators at once spill: RESULTS); each part is stored as it is done and
read back from L2 by the same program, with the row's sum of squares kept, so the norm kernel's read of the o output
from HBM goes.
Checks each tile against the unfused ops, then times both with 24 layers' weights in one CUDA graph, us per layer.

  python perf/bench_o_norm.py [--tokens 16,1024,8192,16384]      (gpu_run.sh onorm)
  TRITON_INTERPRET=1 python perf/bench_o_norm.py --check-only    (the check alone, fp32, on CPU)"""
import sys

import torch
import triton
import triton.language as tl
from bench_fused import LAYERS, per_layer, setup
from triton.tools.tensor_descriptor import TensorDescriptor

from egemma.kernels import triton_ops

PART = 256  # columns of one accumulator: D = 3 parts


@triton.jit
def _o_norm_kernel(a_desc, w_desc, o_desc, h_desc, wp_ptr, rstd_ptr, M, K, eps, BM: tl.constexpr, BK: tl.constexpr,
                   NUM_SMS: tl.constexpr, GPU: tl.constexpr):
    D: tl.constexpr = 768
    for pm in tl.range(tl.program_id(0), tl.cdiv(M, BM), NUM_SMS):
        ss = tl.zeros((BM,), dtype=tl.float32)
        for j in range(3):  # one 256-column part of the o output at a time: one accumulator live
            acc = tl.zeros((BM, 256), dtype=tl.float32)
            for k in range(0, tl.cdiv(K, BK)):
                acc = tl.dot(a_desc.load([pm * BM, k * BK]), w_desc.load([j * 256, k * BK]).T, acc)
            o = acc.to(o_desc.dtype)  # rounded, as the reference's GEMM output is
            of = o.to(tl.float32)
            ss += tl.sum(of * of, 1)
            o_desc.store([pm * BM, j * 256], o)  # read back below from L2 by this program
        if GPU:  # the TMA stores landed, not only left shared memory (Triton waits for .read only)
            tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.debug_barrier()  # every part stored before any is read back
        r1 = tl.rsqrt(ss / D + eps)[:, None]
        ss2 = tl.zeros((BM,), dtype=tl.float32)
        for j in range(3):
            of = o_desc.load([pm * BM, j * 256]).to(tl.float32)
            w = tl.load(wp_ptr + j * 256 + tl.arange(0, 256)).to(tl.float32)[None, :]
            y = (of * r1 * (1.0 + w)).to(h_desc.dtype).to(tl.float32)
            hn = (h_desc.load([pm * BM, j * 256]).to(tl.float32) + y).to(h_desc.dtype)
            h_desc.store([pm * BM, j * 256], hn)
            hf = hn.to(tl.float32)
            ss2 += tl.sum(hf * hf, 1)
        r = pm * BM + tl.arange(0, BM)
        tl.store(rstd_ptr + r, tl.rsqrt(ss2 / D + eps), mask=r < M)


def o_norm(a, w_o, residual, w_post, eps, bm=64, bk=64, stages=3, warps=4):
    """residual += rmsnorm(a @ w_o.T, w_post); returns rsqrt(mean(residual^2) + eps) per row, fp32 [T]: as
    triton_ops.norm_add_rstd(a @ w_o.T, residual, w_post, eps). a [T, K], w_o [768, K], residual [T, 768]."""
    T, K = a.shape
    assert w_o.shape == (3 * PART, K) and residual.shape == (T, 3 * PART) and residual.is_contiguous()
    rstd = torch.empty(T, dtype=torch.float32, device=a.device)
    o = torch.empty_like(residual)  # the o output, written and read back by the same program
    if T:
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count if a.is_cuda else 4
        n = min(triton.cdiv(T, bm), sms)
        desc = TensorDescriptor.from_tensor
        _o_norm_kernel[(n,)](desc(a, [bm, bk]), desc(w_o, [PART, bk]), desc(o, [bm, PART]), desc(residual, [bm, PART]),
                             w_post, rstd, T, K, eps, bm, bk, n, a.is_cuda, num_stages=stages, num_warps=warps)
    return rstd


def reference(a, w_o, residual, w_post, eps):
    return triton_ops.norm_add_rstd(a @ w_o.T, residual, w_post, eps)


def check(T, dev, dt, tile, tol):
    g = torch.Generator(device=dev).manual_seed(T)
    a = torch.randn(T, 768, device=dev, generator=g).to(dt)
    w = (torch.randn(768, 768, device=dev, generator=g) / 768 ** 0.5).to(dt)
    h = (torch.randn(T, 768, device=dev, generator=g) * 10).to(dt)
    wp = (torch.randn(768, device=dev, generator=g) * 0.3).to(dt)
    h1, h2 = h.clone(), h.clone()
    r1, r2 = o_norm(a, w, h1, wp, 1e-6, *tile), reference(a, w, h2, wp, 1e-6)
    err_h = ((h1.float() - h2.float()).abs().max() / h2.float().abs().max()).item()
    err_r = ((r1 - r2).abs().max() / r2.abs().max()).item()
    assert err_h <= tol and err_r <= tol, (T, tile, err_h, err_r)
    return max(err_h, err_r)


def main():
    if "--check-only" in sys.argv:  # the interpreter: fp32, small tiles' worth of rows
        for T in (1, 37, 130):
            print(f"T={T}: max rel err {check(T, torch.device('cpu'), torch.float32, (64, 64, 2, 4), 1e-5):.1e}")
        return
    tokens, dev, dt = setup("16,1024,8192,16384")
    tiles = [(64, 64, 3, 4), (64, 64, 4, 8), (128, 64, 3, 8), (128, 32, 4, 8)]  # (BM, BK, stages, warps)
    ws = [torch.randn(768, 768, device=dev, dtype=dt) / 768 ** 0.5 for _ in range(LAYERS)]
    wp = torch.randn(768, device=dev, dtype=dt) * 0.3
    for T in tokens:
        a = torch.randn(T, 768, device=dev, dtype=dt)
        h = torch.randn(T, 768, device=dev, dtype=dt) * 10
        row = {"cublas+norm_add_rstd": per_layer(lambda i: reference(a, ws[i], h, wp, 1e-6))}
        for tile in tiles:
            try:
                err = check(T, dev, dt, tile, 2e-2)
                row[f"fused {tile} (err {err:.0e})"] = per_layer(lambda i: o_norm(a, ws[i], h, wp, 1e-6, *tile))
            except triton.runtime.errors.OutOfResources as e:
                row[f"fused {tile}"] = float("nan")
                print(f"  tile {tile}: {e}")
        print(f"o+norm T={T}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()) + " us", flush=True)


if __name__ == "__main__":
    main()
