"""The encoder's whole layer stack as one Triton-lang kernel, for batches of a few tokens. There the layered forward
is ~190 kernels of ~3-4 us each, all latency; here one grid of programs passes five grid-wide barriers a layer
(~0.9 us each on the H200), each split in two: a program arrives after its stores and waits only when the next
phase's loads that need no earlier phase (its weight tile) are on their way. A layer's phases:
  A  the previous layer's post-MLP norm + residual add, the input norm (a row scale: its (1 + w) is in qkv), the
     qkv GEMM
  B  q/k norm + RoPE and attention, a program per head
  C  the o GEMM
  D  the post-attention norm + residual add, gate_up (the pre-MLP norm folded in, a row scale) + gelu_and_mul
  E  the down GEMM
then the last post-MLP norm, residual add and final norm. The GEMM phases are spread over the programs by BN output
columns, so that every program reads its own slice of the weights (asked of L2 a phase or two ahead), and each loads
its whole rows at once (as two power-of-2 pieces: 768 = 512 + 256): a K loop waited for memory once a step. The o
and down GEMMs split K over the warps (KSPLIT), which otherwise would each run the whole product. Each
program recomputes the row norms it needs from the phase before (a few rows, from L2); the program of column block
0 writes the residual, into the other of two buffers, so that no phase reads what it writes.

Reference: the layered forward (egemma.engine.model.Encoder.forward) with kernels.native ops, which it matches up to
bf16 rounding (tests/test_kernels.py; under Triton's interpreter, fp32, each phase is its own launch: the kernel
boundary is the barrier). The engine takes it for the CUDA graphs where it replays faster (egemma.engine.graphs:
16 tokens on the H200; perf/engine/bench_small_batch.py)."""
import torch
import triton
import triton.language as tl

from egemma.kernels.triton_ops import gelu_tanh_mul

MAX_TOKENS = 32  # the largest batch it takes: registers hold whole rows (it loses to the layered forward at 32)
BN = 16  # output columns a program computes at a time (gate_up: 16 gelu outputs from 32 columns)
PHASES = 5  # a layer's
# the o and down GEMMs' K split over the warps (4 slices: 0.569 ms a forward against 0.586 with 2, 0.589 with 8
# and 0.616 unsplit on the H200; qkv and gate_up, whose rows come normed from registers, lost split)
KSPLIT = 4


@triton.jit
def _arrive(bar):
    """A grid-wide barrier's first half: this program's stores so far are done, for whoever passes _wait after it."""
    tl.debug_barrier()  # this program's stores are issued before its arrival is
    tl.atomic_add(bar, 1, sem="release", scope="gpu")


@triton.jit
def _wait(bar, n):
    """Its second half: returns once every program has arrived n times (the counter starts at 0). What a program
    loads between the two halves (the next phase's weights) is on its way while it waits."""
    while tl.atomic_add(bar, 0, sem="acquire", scope="gpu") < n * tl.num_programs(0):
        pass
    tl.debug_barrier()


@triton.jit
def _clock():
    """The GPU's nanosecond clock (%globaltimer), for the per-phase times."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _enter(bar, times, ph, first, SYNC: tl.constexpr, TIMES: tl.constexpr):
    """Phase ph's start: the barrier after the phase before (one launch), then program 0's clock (TIMES)."""
    if SYNC:
        if ph > first:
            _wait(bar, ph - first)
    if TIMES:
        if tl.program_id(0) == 0:
            if ph > first:
                tl.store(times + ph, _clock())


@triton.jit
def _prefetch(w_ptr, cb, N, K: tl.constexpr, BNW: tl.constexpr):
    """Ask L2 for column block cb's weight rows (w [N, K] row-major: one contiguous span) without waiting: one bulk
    prefetch, issued by thread 0."""
    if cb * BNW < N:
        size = tl.minimum(BNW, N - cb * BNW) * K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
        tl.inline_asm_elementwise("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                                  "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }", "=r,l,r",
                                  [w_ptr + cb * BNW * K, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rows(ptr, ld, M, K1: tl.constexpr, K2: tl.constexpr, BM: tl.constexpr):
    """Rows [0, BM) of a row-major [M, ld] matrix as two pieces, columns [0, K1) and [K1, K1 + K2) (zeros past M
    and ld). Data written by other programs in this launch: read from L2 (.cg), not a stale L1."""
    r = tl.arange(0, BM)[:, None]
    c1 = tl.arange(0, K1)[None, :]
    c2 = K1 + tl.arange(0, K2)[None, :]
    a = tl.load(ptr + r * ld + c1, mask=(r < M) & (c1 < ld), other=0.0, cache_modifier=".cg")
    b = tl.load(ptr + r * ld + c2, mask=(r < M) & (c2 < ld), other=0.0, cache_modifier=".cg")
    return a, b


@triton.jit
def _vec(ptr, n, K1: tl.constexpr, K2: tl.constexpr):
    """A norm weight's 1 + w as the two pieces, fp32 [1, K1], [1, K2]."""
    c1 = tl.arange(0, K1)
    c2 = K1 + tl.arange(0, K2)
    a = tl.load(ptr + c1, mask=c1 < n, other=0.0).to(tl.float32)
    b = tl.load(ptr + c2, mask=c2 < n, other=0.0).to(tl.float32)
    return (1.0 + a)[None, :], (1.0 + b)[None, :]


@triton.jit
def _rstd(a, b, D, eps):
    """rsqrt(mean(x^2) + eps) per row of x = [a | b], fp32 [BM, 1]."""
    return tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)[:, None]


@triton.jit
def _residual(h_ptr, p_ptr, w_post, h_out, cb, M, eps, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
              BM: tl.constexpr):
    """The residual h + rmsnorm(p, w_post), rounded as the layered forward stores it, as two fp32 pieces with its
    row scale rsqrt(mean(x^2) + eps); column block 0 writes it to h_out."""
    dt = h_ptr.dtype.element_ty
    x1, x2 = _rows(h_ptr, D, M, D1, D2, BM)
    p1, p2 = _rows(p_ptr, D, M, D1, D2, BM)
    x1, x2, p1, p2 = x1.to(tl.float32), x2.to(tl.float32), p1.to(tl.float32), p2.to(tl.float32)
    r = _rstd(p1, p2, D, eps)
    w1, w2 = _vec(w_post, D, D1, D2)
    x1 = (x1 + (p1 * r * w1).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    x2 = (x2 + (p2 * r * w2).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    rows = tl.arange(0, BM)[:, None]
    c1 = tl.arange(0, D1)[None, :]
    c2 = D1 + tl.arange(0, D2)[None, :]
    tl.store(h_out + rows * D + c1, x1.to(dt), mask=(rows < M) & (c1 < D) & (cb == 0))
    tl.store(h_out + rows * D + c2, x2.to(dt), mask=(rows < M) & (c2 < D) & (cb == 0))
    return x1, x2, _rstd(x1, x2, D, eps)


@triton.jit
def _w_rows(w_ptr, cb, N, K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, BNW: tl.constexpr):
    """Column block cb of w [N, K] (row-major) for _mm: its BNW rows as the two K pieces [BNW, K1], [BNW, K2]."""
    return _rows(w_ptr + cb * BNW * K, K, N - cb * BNW, K1, K2, BNW)


@triton.jit
def _mm(x1, x2, w1, w2):
    """[x1 | x2] @ [w1 | w2].T for a column block of w as _w_rows loads it; x rounded to w's dtype first."""
    return tl.dot(x1.to(w1.dtype), tl.trans(w1)) + tl.dot(x2.to(w1.dtype), tl.trans(w2))


@triton.jit
def _split(ptr, rows, K: tl.constexpr, K0: tl.constexpr, KP: tl.constexpr, KS: tl.constexpr, R: tl.constexpr):
    """Columns [K0, K0 + KP) of rows [0, R) of a row-major [rows, K] matrix as KS slices [KS, R, KP / KS] (zeros past
    rows and K), from L2 (.cg): written by other programs in this launch."""
    s = tl.arange(0, KS)[:, None, None]
    r = tl.arange(0, R)[None, :, None]
    c = K0 + s * (KP // KS) + tl.arange(0, KP // KS)[None, None, :]
    return tl.load(ptr + r * K + c, mask=(r < rows) & (c < K), other=0.0, cache_modifier=".cg")


@triton.jit
def _w_split(w_ptr, cb, N, K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, BNW: tl.constexpr,
             KS: tl.constexpr):
    """Column block cb of w [N, K] (row-major) for _mm_split: its two K pieces as KS slices each, [KS, BNW, K1 / KS]
    and [KS, BNW, K2 / KS]."""
    w, nw = w_ptr + cb * BNW * K, N - cb * BNW
    return _split(w, nw, K, 0, K1, KS, BNW), _split(w, nw, K, K1, K2, KS, BNW)


@triton.jit
def _mm_split(x_ptr, M, w1, w2, K: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, BM: tl.constexpr,
              KS: tl.constexpr):
    """[BM, BNW] x @ w.T for x [M, K] row-major in memory and a column block of w as _w_split loads it, with K split
    into KS slices, one a warp: every warp otherwise runs the whole K loop of the small tile (the same product, 48-72
    MMAs in a chain). K is covered by its two power-of-2 pieces."""
    acc = tl.dot(_split(x_ptr, M, K, 0, K1, KS, BM), tl.permute(w1, (0, 2, 1))) + \
        tl.dot(_split(x_ptr, M, K, K1, K2, KS, BM), tl.permute(w2, (0, 2, 1)))
    return tl.sum(acc, 0)


@triton.jit
def _store(ptr, acc, cb, M, N, BM: tl.constexpr, BNW: tl.constexpr):
    """acc [BM, BNW] into columns cb * BNW.. of the row-major [M, N] matrix at ptr."""
    rows = tl.arange(0, BM)[:, None]
    n = cb * BNW + tl.arange(0, BNW)[None, :]
    tl.store(ptr + rows * N + n, acc.to(ptr.dtype.element_ty), mask=(rows < M) & (n < N))


@triton.jit
def _qk(qkv_ptr, head, pos, w_ptr, cos_ptr, sin_ptr, M, eps, NQKV: tl.constexpr, DH: tl.constexpr,
        HP: tl.constexpr, BM: tl.constexpr):
    """Head `head` of the qkv rows RMS-normalised and rotated (rotate-half RoPE from the cos / sin tables
    [positions, DH / 2]), as two halves [BM, HP] (HP >= DH / 2, zero-padded for tl.dot), rounded as the layered
    forward's q / k."""
    dt = qkv_ptr.dtype.element_ty
    HALF: tl.constexpr = DH // 2
    rows = tl.arange(0, BM)
    c = tl.arange(0, HP)
    m = (rows[:, None] < M) & (c[None, :] < HALF)
    src = qkv_ptr + rows[:, None] * NQKV + head * DH + c[None, :]
    x1 = tl.load(src, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / DH + eps)[:, None]
    x1 = x1 * r * (1.0 + tl.load(w_ptr + c, mask=c < HALF, other=0.0).to(tl.float32))[None, :]
    x2 = x2 * r * (1.0 + tl.load(w_ptr + HALF + c, mask=c < HALF, other=0.0).to(tl.float32))[None, :]
    t = pos[:, None] * HALF + c[None, :]
    cs = tl.load(cos_ptr + t, mask=m, other=0.0)
    sn = tl.load(sin_ptr + t, mask=m, other=0.0)
    return (x1 * cs - x2 * sn).to(dt), (x2 * cs + x1 * sn).to(dt)


@triton.jit
def _attend(qkv_ptr, head, L, sliding, rope, n_q, n_k, pos, same, near, M, eps, scale, NQKV: tl.constexpr,
            H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, HP: tl.constexpr, P: tl.constexpr, BM: tl.constexpr):
    """q head `head`'s attention output [BM, DH] of layer L (q/k norm + RoPE first), rounded to the qkv dtype."""
    sl = tl.load(sliding + L)
    keep = same & (near | (sl == 0))
    tab = rope + (1 - sl) * 2 * P * (DH // 2)  # [local cos, local sin, global cos, global sin]
    kv = head // (H // HKV)
    q1, q2 = _qk(qkv_ptr, head, pos, n_q + L * DH, tab, tab + P * (DH // 2), M, eps, NQKV, DH, HP, BM)
    k1, k2 = _qk(qkv_ptr, H + kv, pos, n_k + L * DH, tab, tab + P * (DH // 2), M, eps, NQKV, DH, HP, BM)
    rows = tl.arange(0, BM)
    c = tl.arange(0, DH)
    v = tl.load(qkv_ptr + rows[:, None] * NQKV + (H + HKV + kv) * DH + c[None, :], mask=rows[:, None] < M,
                other=0.0, cache_modifier=".cg")
    s = (tl.dot(q1, tl.trans(k1)) + tl.dot(q2, tl.trans(k2))) * scale  # [BM, BM]
    s = tl.where(keep, s, float("-inf"))
    p = tl.exp(s - tl.max(s, 1)[:, None])  # fp32, rounded before P @ V as FlashAttention does
    return (tl.dot(p.to(v.dtype), v) / tl.sum(p, 1)[:, None]).to(v.dtype)


@triton.jit(do_not_specialize=["n_cu", "M", "window", "first", "last"])  # one compile per batch size: BM
def _layers_kernel(h_a, h_b, qkv_ptr, at_ptr, o_ptr, y_ptr, d_ptr, out_ptr, bar, times, wqkv, wo, wgu, wd, n_attn,
                   n_ff, n_q, n_k, n_final, sliding, rope, pos_ptr, cu_ptr, n_cu, M, eps, scale, window, first, last,
                   D: tl.constexpr, I: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr,
                   HP: tl.constexpr, NL: tl.constexpr, P: tl.constexpr, BM: tl.constexpr, NCU: tl.constexpr,
                   D1: tl.constexpr, D2: tl.constexpr, I1: tl.constexpr, I2: tl.constexpr, NP: tl.constexpr,
                   BN: tl.constexpr, SYNC: tl.constexpr, TIMES: tl.constexpr, KSD: tl.constexpr, KSI: tl.constexpr):
    """Phases first .. last - 1 of the stack (NP = PHASES a layer, then the final norm), a grid barrier after each
    but the last. The residual goes h_a -> h_b in phase A, h_b -> h_a in phase D. BN: output columns a program
    computes at a time (gate_up: BN gelu outputs from 2 BN columns). KSD / KSI: K slices of the o / down GEMMs.
    TIMES: program 0 writes the GPU clock (ns) at the start and after each phase's barrier to times[first..last]."""
    NQKV: tl.constexpr = (H + 2 * HKV) * DH
    pid, G = tl.program_id(0), tl.num_programs(0)
    rows = tl.arange(0, BM)
    pos = tl.load(pos_ptr + rows, mask=rows < M, other=0)
    j = tl.arange(0, NCU)  # which sequence each row is in: the cu_seqlens boundaries at or below it
    cu = tl.load(cu_ptr + j, mask=(j >= 1) & (j < n_cu), other=2 ** 30)
    seq = tl.sum((cu[None, :] <= rows[:, None]).to(tl.int32), 1)
    same = (seq[:, None] == seq[None, :]) & (rows[None, :] < M) | (rows[:, None] == rows[None, :])
    near = tl.abs(pos[:, None] - pos[None, :]) <= window
    if TIMES:
        if pid == 0:
            tl.store(times + first, _clock())
    for ph in range(first, last):
        L = ph // NP
        stage = ph % NP
        if SYNC:  # this program's weight tile of a later phase into L2 while this phase runs (a GPU, one launch)
            if stage == 0:
                if L < NL:  # not in the final phase: past the last layer's weights
                    _prefetch(wo + L * D * H * DH, pid, D, H * DH, BN)
            elif stage == 1:
                _prefetch(wgu + L * 2 * I * D, pid, 2 * I, D, 2 * BN)
            elif stage == 2:
                _prefetch(wd + L * D * I, pid, D, I, BN)
            elif stage == 3:
                if L + 1 < NL:
                    _prefetch(wqkv + (L + 1) * NQKV * D, pid, NQKV, D, BN)
        # Each GEMM phase loads its weight tile (column block pid; none past the last block) before it waits for the
        # phase before: no phase writes weights. Their names differ by phase: a name's type must not change. With
        # a program for each column block (grid), each phase's `for cb` runs once at most, for cb = pid: as an `if`,
        # ptxas spilled 1.1 KB a thread against none.
        if L == NL:  # the last layer's post-MLP norm + residual add, the final norm
            _enter(bar, times, ph, first, SYNC, TIMES)
            if pid == 0:
                # column block 1 as its caller: the residual is not written back, out gets it normed
                x1, x2, r = _residual(h_a, d_ptr, n_ff + (NL - 1) * D, h_b, 1, M, eps, D, D1, D2, BM)
                w1, w2 = _vec(n_final, D, D1, D2)
                c1 = tl.arange(0, D1)[None, :]
                c2 = D1 + tl.arange(0, D2)[None, :]
                dt = out_ptr.dtype.element_ty
                tl.store(out_ptr + rows[:, None] * D + c1, (x1 * r * w1).to(dt), mask=(rows[:, None] < M) & (c1 < D))
                tl.store(out_ptr + rows[:, None] * D + c2, (x2 * r * w2).to(dt), mask=(rows[:, None] < M) & (c2 < D))
        elif stage == 0:  # A: h_a (+ the previous layer's down output, normed) -> h_b; qkv
            wa1, wa2 = _w_rows(wqkv + L * NQKV * D, pid, NQKV, D, D1, D2, BN)
            _enter(bar, times, ph, first, SYNC, TIMES)
            for cb in range(pid, tl.cdiv(NQKV, BN), G):
                # layer 0 adds d = 0 (zeroed at launch): one code path (a runtime branch made phase A 14.7 us against
                # 10.8 with one call per branch, which doubled its code)
                x1, x2, r = _residual(h_a, d_ptr, n_ff + tl.maximum(L - 1, 0) * D, h_b, cb, M, eps, D, D1, D2, BM)
                _store(qkv_ptr, _mm(x1, x2, wa1, wa2) * r, cb, M, NQKV, BM, BN)
        elif stage == 1:  # B: attention, a program per head
            _enter(bar, times, ph, first, SYNC, TIMES)
            if pid < H:
                o = _attend(qkv_ptr, pid, L, sliding, rope, n_q, n_k, pos, same, near, M, eps, scale, NQKV, H, HKV, DH,
                            HP, P, BM)
                c = tl.arange(0, DH)
                tl.store(at_ptr + rows[:, None] * (H * DH) + pid * DH + c[None, :], o, mask=rows[:, None] < M)
        elif stage == 2:  # C: the o GEMM
            wc1, wc2 = _w_split(wo + L * D * H * DH, pid, D, H * DH, D1, D2, BN, KSD)
            _enter(bar, times, ph, first, SYNC, TIMES)
            for cb in range(pid, tl.cdiv(D, BN), G):
                _store(o_ptr, _mm_split(at_ptr, M, wc1, wc2, H * DH, D1, D2, BM, KSD), cb, M, D, BM, BN)
        elif stage == 3:  # D: h_b + the o output, normed -> h_a; gate_up + gelu
            wd1, wd2 = _w_rows(wgu + L * 2 * I * D, pid, 2 * I, D, D1, D2, 2 * BN)
            _enter(bar, times, ph, first, SYNC, TIMES)
            for cb in range(pid, tl.cdiv(I, BN), G):
                x1, x2, r = _residual(h_b, o_ptr, n_attn + L * D, h_a, cb, M, eps, D, D1, D2, BM)
                acc = _mm(x1, x2, wd1, wd2) * r
                g, u = tl.split(tl.reshape(acc, (BM, BN, 2)))
                _store(y_ptr, gelu_tanh_mul(g, u), cb, M, I, BM, BN)
        else:  # E: the down GEMM
            we1, we2 = _w_split(wd + L * D * I, pid, D, I, I1, I2, BN, KSI)
            _enter(bar, times, ph, first, SYNC, TIMES)
            for cb in range(pid, tl.cdiv(D, BN), G):
                _store(d_ptr, _mm_split(y_ptr, M, we1, we2, I, I1, I2, BM, KSI), cb, M, D, BM, BN)
        if SYNC:
            if ph + 1 < last:
                _arrive(bar)
    if TIMES:
        if pid == 0:
            tl.store(times + last, _clock())


def _pieces(k: int) -> tuple[int, int]:
    """k as two powers of 2, each >= 16 (tl.dot's least K), that cover it: 768 -> 512 + 256, 1152 -> 1024 + 128."""
    a = max(16, 1 << (k.bit_length() - 1))
    if a >= k:
        a = max(16, a // 2)
    return a, max(16, triton.next_power_of_2(max(k - a, 1)))


def grid(hidden: int, intermediate: int, qkv_rows: int) -> int:
    """Programs: one per column block of the widest phase (each loads its one weight tile before its barrier)."""
    return max(triton.cdiv(m, BN) for m in (qkv_rows, intermediate, hidden))


def supported(device: torch.device, hidden: int, intermediate: int, heads: int, kv_heads: int,
              head_dim: int) -> bool:
    """Whether layers() runs here: Hopper or newer (its bulk L2 prefetch) with an SM for each program (the
    barriers need them all resident), the heads filling the hidden width, a power-of-2 head_dim; the interpreter
    (a CPU) always."""
    shape = heads * head_dim == hidden and head_dim & (head_dim - 1) == 0
    if not shape or device.type != "cuda":
        return shape
    n = grid(hidden, intermediate, (heads + 2 * kv_heads) * head_dim)
    return torch.cuda.get_device_capability(device)[0] >= 9 and \
        n <= torch.cuda.get_device_properties(device).multi_processor_count


def layers(h: torch.Tensor, w: dict[str, torch.Tensor], rope: torch.Tensor, sliding: torch.Tensor,
           pos: torch.Tensor, cu_seqlens: torch.Tensor, *, heads: int, kv_heads: int, eps: float, scale: float,
           window: int, sync: bool | None = None, times: torch.Tensor | None = None) -> torch.Tensor:
    """The layered forward's loop and final norm: h [T, D] (the scaled embeddings; overwritten) -> the final-normed
    hidden states [T, D]. w: the layers' weights stacked [layers, ...] (qkv, o, gate_up interleaved with the pre-MLP
    norm folded in, down, post_attn_norm, post_ff_norm, q_norm, k_norm: Encoder.stacked) and final_norm [D];
    rope: [local cos, local sin, global cos, global sin], each fp32 [positions, DH / 2]; sliding int32 [layers];
    pos [T]; cu_seqlens int32. sync: one launch with grid barriers (default on a GPU) or one launch per phase (the
    interpreter's way). times: int64 [phases + 1], the GPU clock at the start and after each phase (_layers_kernel's
    TIMES)."""
    T, D = h.shape
    nl, qkv_rows = w["qkv"].shape[:2]
    I = w["down"].shape[2]
    dh = w["q_norm"].shape[1]
    if T > MAX_TOKENS or qkv_rows != (heads + 2 * kv_heads) * dh or \
            not supported(h.device, D, I, heads, kv_heads, dh):
        raise ValueError(f"layers: {T} tokens (at most {MAX_TOKENS}), head_dim {dh} (a power of 2), "
                         f"qkv rows {qkv_rows} for {heads} + 2 x {kv_heads} heads, heads x head_dim = hidden {D}, "
                         f"on {h.device} (a GPU: Hopper or newer, an SM for each of {grid(D, I, qkv_rows)} programs)")
    sync = h.is_cuda if sync is None else sync
    bm = max(16, triton.next_power_of_2(T))
    scratch = torch.empty((4 * T * D + T * qkv_rows + T * I,), dtype=h.dtype, device=h.device)
    h_b, at, o, out = (scratch[i * T * D:(i + 1) * T * D].view(T, D) for i in range(4))
    qkv = scratch[4 * T * D:4 * T * D + T * qkv_rows].view(T, qkv_rows)
    y = scratch[4 * T * D + T * qkv_rows:].view(T, I)
    # the barrier's counter and d, which layer 0's phase A adds as if it were a previous layer's down output, zeroed
    # by one fill: a kernel less in each CUDA graph
    nd = (T * D * h.element_size() + 3) // 4  # d's int32 words
    zeros = torch.zeros(nd + 1, dtype=torch.int32, device=h.device)
    d = zeros[:nd].view(h.dtype)[:T * D].view(T, D)
    bar = zeros[nd:]
    n = grid(D, I, qkv_rows)
    total = PHASES * nl + 1
    phases = [(0, total)] if sync else [(p, p + 1) for p in range(total)]
    (d1, d2), (i1, i2) = _pieces(D), _pieces(I)
    for first, last in phases:
        _layers_kernel[(n,)](h, h_b, qkv, at, o, y, d, out, bar, bar if times is None else times, w["qkv"], w["o"],
                             w["gate_up"], w["down"], w["post_attn_norm"], w["post_ff_norm"],
                             w["q_norm"], w["k_norm"], w["final_norm"], sliding, rope, pos, cu_seqlens,
                             cu_seqlens.shape[0], T, eps, scale, window, first, last, D=D, I=I, H=heads,
                             HKV=kv_heads, DH=dh,
                             HP=max(16, dh // 2), NL=nl, P=rope.shape[1], BM=bm,
                             NCU=triton.next_power_of_2(cu_seqlens.shape[0]), D1=d1, D2=d2, I1=i1, I2=i2, NP=PHASES,
                             BN=BN, KSD=min(KSPLIT, d2 // 16), KSI=min(KSPLIT, i2 // 16), SYNC=sync,
                             TIMES=times is not None, num_warps=8,
                             num_stages=1,  # no pipelining: each phase loads its rows at once
                             # every program resident at once, or the barriers would wait on one never started
                             **({"launch_cooperative_grid": True} if sync else {}))
    return out
