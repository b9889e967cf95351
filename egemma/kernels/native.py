"""Torch-native reference of every fused op. These define the numbers: each faster kernel is tested
against its twin here. Gemma norms scale by (1 + w) and compute in fp32."""
import torch
import torch.nn.functional as F


def _rstd(x, eps):
    """rsqrt(mean(x^2) + eps) over the last dim, fp32 (x [..., D] -> [...]; eps a number or a tensor of that
    shape): an RMSNorm's scale, also on its own where the norm's (1 + w) sits in the next GEMM."""
    return torch.rsqrt(x.float().pow(2).mean(-1) + eps)


def rmsnorm(x, w, eps):  # [T, D] -> [T, D]
    return (x.float() * _rstd(x, eps)[..., None] * (1.0 + w.float())).to(x.dtype)


def norm_add_norm(x, residual, w_post, w_pre, eps):
    """Gemma's post-norm, residual add and next pre-norm: x = rmsnorm(x, w_post); residual += x;
    returns rmsnorm(residual, w_pre). The residual is updated in place."""
    residual.add_(rmsnorm(x, w_post, eps))
    return rmsnorm(residual, w_pre, eps)


def norm_add_rstd(x, residual, w_post, eps):
    """As norm_add_norm, but returns only the updated residual's rstd: the next norm's (1 + w) is folded into the
    GEMM after it (egemma.engine.weights.FOLDED)."""
    residual.add_(rmsnorm(x, w_post, eps))
    return _rstd(residual, eps)


def embed(ids, table, scale, eps):
    """The residual stream's start and its rows' rstd: (table[ids] * scale [T, D], as transformers rounds it to the
    table's dtype, rstd of that [T])."""
    h = F.embedding(ids, table) * scale
    return h, _rstd(h, eps)


def gelu_tanh_and_mul(gate_up):
    """[T, 2I] with gate j and up j in columns 2j, 2j + 1 (the gate_up weight's rows interleaved at load,
    egemma.engine.weights) -> gelu_tanh(gate) * up [T, I]."""
    return F.gelu(gate_up[:, 0::2], approximate="tanh") * gate_up[:, 1::2]


def gate_up_gelu(x, w_gate_up, rstd=None):
    """The MLP's first half: [T, D] @ [2I, D] (interleaved) -> [T, I]; rstd fp32 [T]: each row's scale before gelu."""
    gu = x @ w_gate_up.T
    return gelu_tanh_and_mul(gu if rstd is None else (gu.float() * rstd[:, None]).to(gu.dtype))


def mlp_up(x, residual, w_post, w_gate_up, eps):
    """The attention block's end and the MLP's first half: x = rmsnorm(x, w_post); residual += x; returns
    gelu_tanh_and_mul(rmsnorm(residual) @ w_gate_up.T) [T, I], where the pre-MLP norm's (1 + w) is folded into
    w_gate_up's columns (egemma.engine.weights.FOLDED), so the norm here has none."""
    return gate_up_gelu(norm_add_norm(x, residual, w_post, torch.zeros_like(w_post), eps), w_gate_up)


def mean_pool(x, cu_seqlens, n):
    """Mean of each sequence's rows, fp32 [n, D]: sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] of x [T, D]
    (an empty one gives 0; rows outside the n sequences may hold anything, even NaN). One reduction a sequence over
    its own rows: its bits do not depend on where it sits in the batch or what else is there (a one-hot matmul's
    did, through the GEMM's blocking over T)."""
    cu = cu_seqlens[:n + 1].tolist()
    out = torch.zeros((n, x.shape[1]), dtype=torch.float32, device=x.device)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if b > a:
            out[i] = x[a:b].float().mean(0)
    return out


def rope_table(base, head_dim, max_pos, device):
    """cos / sin [max_pos, head_dim // 2] fp32, computed as transformers' default RoPE does."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = torch.arange(max_pos, device=device).float()[:, None] * inv_freq[None, :]
    return torch.cos(freqs), torch.sin(freqs)


def qk_norm_rope(qkv, pos, q_w, k_w, cos, sin, heads, kv_heads, eps, rstd):
    """Split the joined qkv GEMM output, RMS-normalise q and k per head, rotate them (rotate-half RoPE).
    qkv [T, (H + 2 Hkv) * Dh] -> q [T, H, Dh], k [T, Hkv, Dh], v [T, Hkv, Dh]. The GEMM read rows whose RMSNorm
    was left to here, rstd fp32 [T] their scales: v takes them; q and k, normalised per head anyway, only as their
    norms' eps / rstd^2 (what normalising the rows first comes to)."""
    T = qkv.shape[0]
    q, k, v = qkv.view(T, heads + 2 * kv_heads, -1).split([heads, kv_heads, kv_heads], dim=1)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # [T, 1, Dh/2]
    eps_rows = eps / rstd.pow(2)[:, None]  # [T, 1]

    def norm_rope(x, w):
        xf = x.float() * _rstd(x, eps_rows)[..., None] * (1.0 + w.float())
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)

    return norm_rope(q, q_w), norm_rope(k, k_w), (v.float() * rstd[:, None, None]).to(v.dtype)


def attention(q, k, v, cu_seqlens, max_seqlen, window, scale):
    """Bidirectional attention within each packed sequence, |i - j| <= window when window >= 0.
    q [T, H, Dh], k/v [T, Hkv, Dh] -> [T, H, Dh]. One SDPA call per sequence."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        mask = None
        if 0 <= window < b - a:
            i = torch.arange(b - a, device=q.device)
            mask = (i[:, None] - i[None, :]).abs() <= window
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b] = o.transpose(0, 1)
    return out
