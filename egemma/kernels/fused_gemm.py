"""The MLP's gate_up GEMM with gelu_tanh(gate) * up in its epilogue (Triton-lang, TMA loads, one persistent
program per SM): the [T, 2I] GEMM output never goes to memory and one kernel per layer goes. The weight's rows are
interleaved at load (egemma.engine.weights: gate j, up j as rows 2j, 2j + 1), so a gate and its up are two adjacent
accumulator columns, which the wgmma layout keeps in one thread: splitting them costs nothing. With a row scale
(the pre-MLP RMSNorm's, its weight folded into w at load) x is the unnormalised residual and the norm's output is
never written. Reference: native.gate_up_gelu (tests/test_kernels.py). Whether it beats norm + cuBLAS + a separate
gelu_and_mul is timed per token bucket at load (egemma.engine.select, mlp_up): on the H200 it is picked for most
buckets from 16 tokens on (perf/engine/bench_fused.py)."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from egemma.kernels.triton_ops import gelu_tanh_mul


@dataclass(frozen=True)
class Tile:
    """A launch configuration: BM x BN GEMM output tiles (BN / 2 outputs), BK deep steps, pipeline stages, warps."""
    bm: int
    bn: int
    bk: int
    stages: int
    warps: int

    def __str__(self):
        return f"{self.bm}x{self.bn}x{self.bk}/s{self.stages}w{self.warps}"


# The candidates timed at load (of more timed once): wide tiles win on many rows, narrow ones spread
# a few rows' weight reads over more SMs.
TILES = (Tile(128, 256, 64, 4, 8), Tile(64, 256, 64, 4, 4), Tile(64, 128, 64, 4, 4), Tile(64, 64, 128, 3, 4))


@triton.jit
def _pid(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """Tile -> (row block, column block), row blocks in groups so that a group's weight columns stay in L2."""
    in_group = GROUP_M * n_n
    first = (tile // in_group) * GROUP_M
    size = tl.minimum(n_m - first, GROUP_M)
    return first + (tile % in_group) % size, (tile % in_group) // size


# One compile a tile whatever the rows: with the program count a constexpr, every token bucket was a compile of its
# own (22 at load, most of the cold boot's kernel phase).
@triton.jit(do_not_specialize=["M", "programs"])
def _gate_up_gelu_kernel(x_desc, w_desc, o_desc, s_ptr, M, N, K, programs, BM: tl.constexpr, BN: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr, SCALE: tl.constexpr):
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), n_m * n_n, programs, flatten=True):
        pm, pn = _pid(tile, n_m, n_n, GROUP_M)
        # x's rows are unnormalised: their RMSNorm scale, loaded before the K loop so that its latency hides there
        if SCALE:
            rows = pm * BM + tl.arange(0, BM)
            scale = tl.load(s_ptr + rows, mask=rows < M, other=0.0)[:, None]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            acc = tl.dot(x_desc.load([pm * BM, k * BK]), w_desc.load([pn * BN, k * BK]).T, acc)
        if SCALE:
            acc = acc * scale
        g, u = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))  # [BM, BN / 2] each
        o_desc.store([pm * BM, pn * (BN // 2)], gelu_tanh_mul(g, u).to(o_desc.dtype))


def supported(device: torch.device) -> bool:
    """TMA and wgmma: Hopper or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def aligned(hidden: int, intermediate: int, dtype: torch.dtype) -> bool:
    """Whether TMA can load x's and store the output's rows: each a multiple of 16 bytes."""
    size = torch.empty(0, dtype=dtype).element_size()
    return (hidden * size) % 16 == 0 and (intermediate * size) % 16 == 0


def gate_up_gelu(x: torch.Tensor, w_gate_up: torch.Tensor, tile: Tile,
                 rstd: torch.Tensor | None = None) -> torch.Tensor:
    """native.gate_up_gelu(x, w_gate_up, rstd) in one kernel: x [T, D], w_gate_up [2I, D] interleaved, rstd fp32 [T]
    (each row's scale before gelu, or none) -> [T, I]."""
    T, K = x.shape
    N = w_gate_up.shape[0]
    if not (x.is_contiguous() and w_gate_up.is_contiguous() and aligned(K, N // 2, x.dtype)):
        raise ValueError(f"gate_up_gelu: TMA needs contiguous rows of a multiple of 16 bytes (x {tuple(x.shape)}, "
                         f"w {tuple(w_gate_up.shape)}, {x.dtype})")
    if rstd is not None and not (rstd.shape == (T,) and rstd.dtype == torch.float32 and rstd.is_contiguous()
                                 and rstd.device == x.device):
        raise ValueError(f"gate_up_gelu: rstd must be contiguous fp32 [{T}] on {x.device}, got "
                         f"{rstd.dtype} {tuple(rstd.shape)} on {rstd.device}")
    out = torch.empty((T, N // 2), dtype=x.dtype, device=x.device)
    if T:
        tiles = triton.cdiv(T, tile.bm) * triton.cdiv(N, tile.bn)
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 4
        n = min(tiles, sms)
        desc = TensorDescriptor.from_tensor
        _gate_up_gelu_kernel[(n,)](desc(x, [tile.bm, tile.bk]), desc(w_gate_up, [tile.bn, tile.bk]),
                                   desc(out, [tile.bm, tile.bn // 2]), x if rstd is None else rstd, T, N, K, n,
                                   tile.bm, tile.bn, tile.bk, 8, rstd is not None, num_stages=tile.stages,
                                   num_warps=tile.warps)
    return out
