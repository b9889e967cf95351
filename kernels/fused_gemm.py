"""Triton-lang GEMMs with fused epilogues: the qkv projection with q/k RMSNorm + RoPE, the gate_up projection with
gelu_tanh(gate) * up; optionally with the RMSNorm before the GEMM folded in too (`prenorm`). Each equals its
composition in `kernels.native` (GEMM, then the op) up to rounding: the epilogue works on the fp32 accumulator,
where the composition rounds the GEMM output to bf16 first.

x [T, K] @ w.T with w [N, K] as PyTorch stores Linear weights; bf16 inputs, fp32 accumulators (tl.dot: wgmma on
Hopper). `config=None` autotunes per power-of-two bucket of T (run it once per bucket before CUDA-graph capture:
tuning synchronises); a `triton.Config` runs that tile directly (tests, fixed tables). Nothing here syncs or
allocates beyond the outputs' torch.empty, so both ops are graph-capturable."""
import torch
import triton
import triton.language as tl

_SMEM = 232448  # bytes of shared memory one program may use on sm_90 (H100/H200)


def _cfg(bm, bk, warps, stages, bn=None):
    kw = dict(BLOCK_M=bm, BLOCK_K=bk) if bn is None else dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return triton.Config(kw, num_warps=warps, num_stages=stages)


_K_STAGES = ((64, 3), (64, 4), (128, 2))  # (BLOCK_K, pipeline depth): deeper K tiles leave room for 2 stages
_QKV_CONFIGS = [_cfg(bm, bk, w, s) for bm in (32, 64, 128) for bk, s in _K_STAGES for w in (4, 8)]
_GATE_UP_CONFIGS = [_cfg(bm, bk, w, s, bn) for bm in (32, 64, 128) for bn in (32, 64, 128) for bk, s in _K_STAGES
                    for w in (4, 8)]


def _prune(width):
    """Keep the configs that fit: pipeline buffers within shared memory, accumulators within 128 registers a
    thread (more spills), and tiles sized to T. T <= 256 is weight-bandwidth bound: small tiles, so that more
    programs read the weights in parallel; BLOCK_M 128 only from T >= 1024 (enough programs to fill the GPU).
    width(config, args): the weight rows one program reads (its accumulators' total width)."""
    def prune(configs, args, **_):
        t = args["T_BUCKET"]
        keep = []
        for c in configs:
            bm, bk, bn, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_K"], c.kwargs.get("BLOCK_N"), width(c, args)
            fits = c.num_stages * (bm + n) * bk * 2 <= _SMEM and bm * n <= 128 * 32 * c.num_warps
            if t <= 256:
                sized = bm <= 64 and bn != 128
            else:
                sized = bm >= 64 and bn != 32 and (bm != 128 or t >= 1024)
            if fits and sized:
                keep.append(c)
        return keep or configs[:1]
    return prune


def _bench(fn, quantiles):  # shorter than Triton's default 25 + 100 ms a config: the candidates are many
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


@triton.jit
def _dual_gemm(a_ptrs, b_ptrs, b2_off, K, BLOCK_M: tl.constexpr, N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, PRE_NORM: tl.constexpr):
    """acc1 = A @ B, acc2 = A @ B' over all of K (a_ptrs [BLOCK_M, BLOCK_K], b_ptrs [BLOCK_K, N] at k = 0;
    B' = B + b2_off), and with PRE_NORM each A row's sum of squares, taken from the tiles the dots read."""
    kk = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b1 = tl.load(b_ptrs)
            b2 = tl.load(b_ptrs + b2_off)
        else:
            km = kk + k0 < K
            a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
            b1 = tl.load(b_ptrs, mask=km[:, None], other=0.0)
            b2 = tl.load(b_ptrs + b2_off, mask=km[:, None], other=0.0)
        if PRE_NORM:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, 1)
        acc1 = tl.dot(a, b1, acc1)
        acc2 = tl.dot(a, b2, acc2)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc1, acc2, ss


@triton.jit
def _qkv_norm_rope_kernel(x_ptr, w_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
                          T, K, sx, eps, T_BUCKET,
                          H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, PRE_NORM: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # One program: BLOCK_M tokens x one head (q heads, then k, then v). The head's two halves are two
    # accumulators, so rotate-half RoPE pairs acc1 with acc2 elementwise. Head is the fast index: the programs
    # sharing an x tile run together and find it in L2.
    NH: tl.constexpr = H + 2 * HKV
    DH: tl.constexpr = 2 * HALF
    pid = tl.program_id(0)
    h = pid % NH
    rows = (pid // NH) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, HALF)
    kk = tl.arange(0, BLOCK_K)
    # Rows past T load row (r mod T) and are never stored: the main loop needs no row mask.
    a_ptrs = x_ptr + (rows % T)[:, None] * sx + kk[None, :]
    b_ptrs = w_ptr + (h * DH + c)[None, :] * K + kk[:, None]  # [BLOCK_K, HALF], w read transposed
    acc1, acc2, ss = _dual_gemm(a_ptrs, b_ptrs, HALF * K, K, BLOCK_M, HALF, BLOCK_K, EVEN_K, PRE_NORM)
    if PRE_NORM:  # rmsnorm(x) @ w.T == rsqrt(mean(x^2) + eps) * (x @ (w * (1 + norm_w)).T): a per-row scale
        pre = tl.rsqrt(ss / K + eps)[:, None]
        acc1 *= pre
        acc2 *= pre
    live = (rows < T)[:, None]
    if h < H + HKV:  # q or k head: RMSNorm over the head (both halves), scale by (1 + w), rotate
        if h < H:
            w1 = tl.load(qw_ptr + c).to(tl.float32)
            w2 = tl.load(qw_ptr + HALF + c).to(tl.float32)
            dst = q_ptr + rows[:, None] * (H * DH) + h * DH + c[None, :]
        else:
            w1 = tl.load(kw_ptr + c).to(tl.float32)
            w2 = tl.load(kw_ptr + HALF + c).to(tl.float32)
            dst = k_ptr + rows[:, None] * (HKV * DH) + (h - H) * DH + c[None, :]
        r = tl.rsqrt((tl.sum(acc1 * acc1, 1) + tl.sum(acc2 * acc2, 1)) / DH + eps)[:, None]
        x1 = acc1 * r * (1.0 + w1[None, :])
        x2 = acc2 * r * (1.0 + w2[None, :])
        p = tl.load(pos_ptr + rows, mask=rows < T, other=0)[:, None]
        cs = tl.load(cos_ptr + p * HALF + c[None, :])
        sn = tl.load(sin_ptr + p * HALF + c[None, :])
        tl.store(dst, (x1 * cs - x2 * sn).to(q_ptr.dtype.element_ty), mask=live)
        tl.store(dst + HALF, (x2 * cs + x1 * sn).to(q_ptr.dtype.element_ty), mask=live)
    else:
        dst = v_ptr + rows[:, None] * (HKV * DH) + (h - H - HKV) * DH + c[None, :]
        tl.store(dst, acc1.to(v_ptr.dtype.element_ty), mask=live)
        tl.store(dst + HALF, acc2.to(v_ptr.dtype.element_ty), mask=live)


@triton.jit
def _gate_up_gelu_kernel(x_ptr, w_ptr, out_ptr, T, K, I, sx, so, eps, T_BUCKET, PRE_NORM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr):
    # One program: BLOCK_M tokens x BLOCK_N outputs; gate columns j and up columns I + j are two accumulators.
    nt = tl.cdiv(I, BLOCK_N)
    pid = tl.program_id(0)
    rows = (pid // nt) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % nt) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (rows % T)[:, None] * sx + kk[None, :]  # out-of-range rows/cols: wrapped, never stored
    b_ptrs = w_ptr + (cols % I)[None, :] * K + kk[:, None]  # [BLOCK_K, BLOCK_N] of the gate rows
    g, u, ss = _dual_gemm(a_ptrs, b_ptrs, I * K, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRE_NORM)
    if PRE_NORM:
        pre = tl.rsqrt(ss / K + eps)[:, None]
        g *= pre
        u *= pre
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh is +-1 to fp32 precision beyond; keeps exp finite
    t = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)  # tanh(z)
    m = (rows < T)[:, None] & (cols < I)[None, :]
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], (0.5 * g * (1.0 + t) * u).to(out_ptr.dtype.element_ty),
             mask=m)


_even_k = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
_qkv_fixed = _even_k(_qkv_norm_rope_kernel)
_gate_up_fixed = _even_k(_gate_up_gelu_kernel)
_qkv_tuned = triton.autotune(_QKV_CONFIGS, key=["T_BUCKET", "K", "HALF", "PRE_NORM"], do_bench=_bench,
                             prune_configs_by={"early_config_prune": _prune(lambda c, a: 2 * a["HALF"])})(_qkv_fixed)
_gate_up_tuned = triton.autotune(_GATE_UP_CONFIGS, key=["T_BUCKET", "K", "I", "PRE_NORM"], do_bench=_bench,
                                 prune_configs_by={"early_config_prune": _prune(lambda c, a: 2 * c.kwargs["BLOCK_N"])}
                                 )(_gate_up_fixed)


def _launch(tuned, fixed, grid, args, config):
    if config is None:
        tuned[grid](*args)
    else:
        fixed[grid](*args, **config.all_kwargs())


TUNED = {"qkv_norm_rope": _qkv_tuned, "gate_up_gelu": _gate_up_tuned}  # the autotuners, by op


def best_config(op: str, T: int, prenorm=False):
    """The config autotuning chose for op ('qkv_norm_rope' / 'gate_up_gelu') at T tokens, or None if not tuned."""
    hits = [c for key, c in TUNED[op].cache.items() if key[0] == triton.next_power_of_2(T) and key[3] == prenorm]
    return hits[0] if hits else None


def fold_norm(w, norm_w):
    """w [N, D] with a Gemma RMSNorm's (1 + norm_w) [D] folded into its columns, in fp32 then rounded: the weight
    for `prenorm=True`, which then computes GEMM(rmsnorm(x, norm_w)) from the raw x (once, at load)."""
    return (w.float() * (1.0 + norm_w.float())[None, :]).to(w.dtype).contiguous()


def qkv_norm_rope(x, w_qkv, pos, q_w, k_w, cos, sin, heads, kv_heads, eps, prenorm=False, config=None):
    """native.qk_norm_rope(x @ w_qkv.T, pos, q_w, k_w, cos, sin, heads, kv_heads, eps) in one kernel.
    x [T, D], w_qkv [(H + 2 Hkv) Dh, D] -> q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh] (all contiguous).
    prenorm: x is not yet normalised and w_qkv = fold_norm(w, norm_w): the same for x -> rmsnorm(x, norm_w, eps)."""
    T, K = x.shape
    dh = q_w.shape[0]
    assert w_qkv.shape == ((heads + 2 * kv_heads) * dh, K) and x.stride(1) == 1 and w_qkv.is_contiguous()
    assert dh % 2 == 0 and triton.next_power_of_2(dh) == dh, "head_dim must be a power of two"
    assert cos.shape[1] == sin.shape[1] == dh // 2 and cos.is_contiguous() and sin.is_contiguous()
    q = torch.empty((T, heads, dh), dtype=x.dtype, device=x.device)
    k = torch.empty((T, kv_heads, dh), dtype=x.dtype, device=x.device)
    v = torch.empty((T, kv_heads, dh), dtype=x.dtype, device=x.device)
    if T:
        nh = heads + 2 * kv_heads
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * nh,)  # noqa: E731
        args = (x, w_qkv, pos.contiguous(), q_w, k_w, cos, sin, q, k, v, T, K, x.stride(0), eps,
                triton.next_power_of_2(T), heads, kv_heads, dh // 2, prenorm)
        _launch(_qkv_tuned, _qkv_fixed, grid, args, config)
    return q, k, v


def gate_up_gelu(x, w_gate_up, eps=1e-6, prenorm=False, config=None):
    """native.gelu_tanh_and_mul(x @ w_gate_up.T) in one kernel. x [T, D], w_gate_up [2I, D] -> [T, I].
    prenorm, eps: as for qkv_norm_rope."""
    T, K = x.shape
    I = w_gate_up.shape[0] // 2
    assert w_gate_up.shape == (2 * I, K) and x.stride(1) == 1 and w_gate_up.is_contiguous()
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T:
        grid = lambda meta: (triton.cdiv(T, meta["BLOCK_M"]) * triton.cdiv(I, meta["BLOCK_N"]),)  # noqa: E731
        args = (x, w_gate_up, out, T, K, I, x.stride(0), out.stride(0), eps, triton.next_power_of_2(T), prenorm)
        _launch(_gate_up_tuned, _gate_up_fixed, grid, args, config)
    return out
