"""Triton-lang versions of the fused ops, for hosts without sgl-kernel, and for those no library provides: the
embedding gather with its row scale, q/k-norm + RoPE with v's row scale, the norms that write only a row scale, and
the segment-mean pooling. Each matches its twin in `kernels.native` to fp32 rounding
(tests/test_kernels.py). They also run under TRITON_INTERPRET=1 on CPU, which is how CI tests them."""
import torch
import triton
import triton.language as tl


@triton.jit
def _norm_add_kernel(x_ptr, res_ptr, w_post_ptr, w_ptr, out_ptr, D, eps, sx, sr, so, RSTD: tl.constexpr,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    wp = tl.load(w_post_ptr + cols, mask=m, other=0.0).to(tl.float32)
    x = (x * tl.rsqrt(tl.sum(x * x, 0) / D + eps) * (1.0 + wp)).to(x_ptr.dtype.element_ty).to(tl.float32)
    x += tl.load(res_ptr + row * sr + cols, mask=m, other=0.0).to(tl.float32)
    x = x.to(res_ptr.dtype.element_ty)  # the reference normalises the stored (rounded) residual
    tl.store(res_ptr + row * sr + cols, x, mask=m)
    x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if RSTD:  # the row's scale only: the GEMM after it applies it (the norm's weight is folded into the GEMM's)
        tl.store(out_ptr + row, r)
    else:
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * so + cols, (x * r * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=m)


# The row kernels' launch shapes. Each row's reduction order follows the warp count, so a deterministic engine
# (egemma.engine.tuning) launches them with one shape whatever the batch: DETERMINISTIC_* (the large-batch choices).
DETERMINISTIC_ROW_WARPS, DETERMINISTIC_QK_WARPS, DETERMINISTIC_POOL_TILE = 2, 1, (128, 32, 4)


def _row_warps(T: int, warps: int) -> int:
    # 2 warps a row on large batches (more rows resident): faster from 4096 tokens (perf/engine/bench_norms.py)
    return warps or (2 if T >= 4096 else 4)


def _norm_add(x, res, w_post, w, out, eps, rstd_only, warps):
    if x.shape[0]:
        _norm_add_kernel[(x.shape[0],)](x, res, w_post, w, out, x.shape[1], eps, x.stride(0), res.stride(0),
                                        out.stride(0), RSTD=rstd_only, BLOCK=triton.next_power_of_2(x.shape[1]),
                                        num_warps=_row_warps(x.shape[0], warps))
    return out


def norm_add_norm(x, residual, w_post, w_pre, eps, *, warps=0):
    """x = rmsnorm(x, w_post); residual += x; returns rmsnorm(residual, w_pre), written over x: one pass. warps: a
    launch shape fixed whatever the batch (0: by its size)."""
    return _norm_add(x, residual, w_post, w_pre, x, eps, False, warps)


def norm_add_rstd(x, residual, w_post, eps, *, warps=0):
    """As norm_add_norm, but returns only the residual's rsqrt(mean(residual^2) + eps) per row, fp32 [T]: for a GEMM
    whose rows take it later, with the norm's (1 + w) folded into its weight (egemma.engine.weights.FOLDED)."""
    return _norm_add(x, residual, w_post, w_post, torch.empty(x.shape[0], dtype=torch.float32, device=x.device),
                     eps, True, warps)


@triton.jit
def _embed_kernel(ids_ptr, table_ptr, out_ptr, rstd_ptr, D, scale, eps, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < D
    row = tl.load(ids_ptr + t).to(tl.int64)
    x = tl.load(table_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32) * scale
    x = x.to(out_ptr.dtype.element_ty)  # the residual as stored; its scale is taken from the rounded values
    tl.store(out_ptr + t * D + cols, x, mask=m)
    x = x.to(tl.float32)
    tl.store(rstd_ptr + t, tl.rsqrt(tl.sum(x * x, 0) / D + eps))


def embed(ids, table, scale, eps, *, warps=0):
    """As native.embed: rows of table [V, D] (contiguous) x scale -> ([T, D], fp32 rsqrt(mean(row^2) + eps) [T]).
    warps: as norm_add_norm's."""
    T, D = ids.shape[0], table.shape[1]
    out = torch.empty((T, D), dtype=table.dtype, device=table.device)
    rstd = torch.empty(T, dtype=torch.float32, device=table.device)
    if T:
        _embed_kernel[(T,)](ids, table, out, rstd, D, float(scale), eps, BLOCK=triton.next_power_of_2(D),
                            num_warps=_row_warps(T, warps))
    return out, rstd


@triton.jit
def gelu_tanh_mul(g, u):
    """gelu_tanh(g) * u in fp32 (also the epilogue of kernels.fused_gemm)."""
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh is +-1 to fp32 precision beyond; keeps exp finite
    return 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)) * u  # 1 + tanh(z)


@triton.jit
def _gelu_tanh_and_mul_kernel(gu_ptr, out_ptr, T, I, s_in, s_out, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]  # [1, BLOCK_I]
    pairs = tl.program_id(1) * 2 * BLOCK_I + tl.arange(0, 2 * BLOCK_I)[None, :]  # gate j, up j adjacent
    x = tl.load(gu_ptr + rows * s_in + pairs, mask=(rows < T) & (pairs < 2 * I), other=0.0).to(tl.float32)
    g, u = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_I, 2)))
    tl.store(out_ptr + rows * s_out + cols, gelu_tanh_mul(g, u).to(out_ptr.dtype.element_ty),
             mask=(rows < T) & (cols < I))


def gelu_tanh_and_mul(gate_up):  # [T, 2I] gate j and up j in columns 2j, 2j + 1 -> [T, I]
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        # 16-row x 128-column tiles: 128 divides Gemma's 1152, so no lane idles on a partial column block (a
        # 1024-wide block per row left 44% of the second one idle), and each row's 512 bytes load as vectors.
        _gelu_tanh_and_mul_kernel[(triton.cdiv(T, 16), triton.cdiv(I, 128))](
            gate_up, out, T, I, gate_up.stride(0), out.stride(0), BLOCK_T=16, BLOCK_I=128)
    return out


@triton.jit
def _mean_pool_kernel(x_ptr, cu_ptr, out_ptr, D, sx, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    start = tl.load(cu_ptr + s)
    end = tl.load(cu_ptr + s + 1)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for r in range(start, end, BLOCK_R):
        rows = r + tl.arange(0, BLOCK_R)[:, None]  # [BLOCK_R, 1]
        m = (rows < end) & (cols[None, :] < D)
        acc += tl.load(x_ptr + rows * sx + cols[None, :], mask=m, other=0.0).to(tl.float32)
    n = tl.maximum(end - start, 1).to(tl.float32)
    tl.store(out_ptr + s * D + cols, tl.sum(acc, 0) / n, mask=cols < D)


def mean_pool(x, cu_seqlens, n, *, tile=None):
    """As native.mean_pool in one launch: one program per sequence and column block, stepping down its own rows.
    tile: (rows a step, columns, warps), fixed whatever the batch (a deterministic engine; perf/engine/bench_norms.py),
    else by the batch's size."""
    out = torch.empty((n, x.shape[1]), dtype=torch.float32, device=x.device)
    if n:
        # from 4096 tokens 32 columns a program (more programs) and 128 rows a step, below 64 x 64: each faster at its
        # sizes (perf/engine/bench_norms.py)
        br, bd, warps = tile or ((128, 32, 4) if x.shape[0] >= 4096 else (64, 64, 4))
        _mean_pool_kernel[(n, triton.cdiv(x.shape[1], bd))](x, cu_seqlens, out, x.shape[1], x.stride(0),
                                                             BLOCK_R=br, BLOCK_D=bd, num_warps=warps)
    return out


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, rstd_ptr, q_ptr, k_ptr, v_ptr, s_qkv,
                         eps, H: tl.constexpr, HKV: tl.constexpr, NH: tl.constexpr, HALF: tl.constexpr,
                         VB: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, NH)[:, None]  # q heads, then k heads: [NH, 1]
    c = tl.arange(0, HALF)[None, :]  # [1, HALF]
    live = h < H + HKV
    src = qkv_ptr + t * s_qkv + h * (2 * HALF) + c
    x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
    rt = tl.load(rstd_ptr + t)
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps / (rt * rt))[:, None]
    is_q = h < H
    w1 = tl.where(is_q, tl.load(qw_ptr + c).to(tl.float32), tl.load(kw_ptr + c).to(tl.float32))
    w2 = tl.where(is_q, tl.load(qw_ptr + HALF + c).to(tl.float32), tl.load(kw_ptr + HALF + c).to(tl.float32))
    x1 = x1 * r * (1.0 + w1)
    x2 = x2 * r * (1.0 + w2)
    p = tl.load(pos_ptr + t)
    cs = tl.load(cos_ptr + p * HALF + c)
    sn = tl.load(sin_ptr + p * HALF + c)
    o1 = (x1 * cs - x2 * sn).to(q_ptr.dtype.element_ty)
    o2 = (x2 * cs + x1 * sn).to(q_ptr.dtype.element_ty)
    qdst = q_ptr + t * (H * 2 * HALF) + h * (2 * HALF) + c
    tl.store(qdst, o1, mask=is_q)
    tl.store(qdst + HALF, o2, mask=is_q)
    is_k = live & (h >= H)
    kdst = k_ptr + t * (HKV * 2 * HALF) + (h - H) * (2 * HALF) + c
    tl.store(kdst, o1, mask=is_k)
    tl.store(kdst + HALF, o2, mask=is_k)
    vc = tl.arange(0, VB)  # the v heads, contiguous after q's and k's
    vm = vc < HKV * 2 * HALF
    v = tl.load(qkv_ptr + t * s_qkv + (H + HKV) * 2 * HALF + vc, mask=vm).to(tl.float32) * rt
    tl.store(v_ptr + t * (HKV * 2 * HALF) + vc, v.to(v_ptr.dtype.element_ty), mask=vm)


def qk_norm_rope(qkv, pos, q_w, k_w, cos, sin, heads, kv_heads, eps, rstd, *, warps=0):
    """As native.qk_norm_rope, in one pass over the qkv GEMM output: q/k RMSNorm per head then RoPE from the cos/sin
    tables, v scaled by rstd. qkv [T, (H + 2 Hkv) * Dh] -> q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh], all new.
    warps: a launch shape fixed whatever the batch (a deterministic engine; perf/engine/bench_norms.py), else by its
    size."""
    T = qkv.shape[0]
    dh = q_w.shape[0]
    if not (rstd.shape == (T,) and rstd.dtype == torch.float32 and rstd.is_contiguous()):
        raise ValueError(f"qk_norm_rope: rstd must be contiguous fp32 [{T}], got {rstd.dtype} {tuple(rstd.shape)}")
    q = torch.empty((T, heads, dh), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((T, kv_heads, dh), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty((T, kv_heads, dh), dtype=qkv.dtype, device=qkv.device)
    if T:
        # 1 warp a token on large batches (more tokens resident): faster at 16k tokens, no difference on small ones
        # (perf/engine/bench_norms.py)
        _qk_norm_rope_kernel[(T,)](qkv, pos, q_w, k_w, cos, sin, rstd, q, k, v, qkv.stride(0), eps, H=heads,
                                   HKV=kv_heads, NH=triton.next_power_of_2(heads + kv_heads), HALF=dh // 2,
                                   VB=triton.next_power_of_2(kv_heads * dh), num_warps=warps or (1 if T >= 4096 else 4))
    return q, k, v
