"""The fused-epilogue GEMMs against their torch-native compositions (GEMM, then the kernels.native op) on odd sizes
and fresh random data. On CPU in Triton's interpreter (fp32, small fixed tiles); on a GPU host in bf16, with a
Hopper-sized tile and once through autotuning at Gemma's shapes."""
import pytest
import torch

CUDA = torch.cuda.is_available()  # without one, conftest.py put Triton in interpreter mode
triton = pytest.importorskip("triton")

from egemma.kernels import fused_gemm, native  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-5  # bf16 outputs carry ~3 significant digits
# The interpreter's cost grows with the number of programs: small tiles, few of them. On the GPU: a wgmma tile.
FIXED = (triton.Config(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64), num_warps=4, num_stages=3) if CUDA
         else triton.Config(dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=32), num_warps=4, num_stages=1))
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")  # the interpreter's


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(DTYPE)


def close(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    assert ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item() <= TOL


def inputs(T, D, prenorm):
    """(x the kernel reads, x the reference GEMM reads, fold(w)): with prenorm the kernel reads the raw residual
    stream and the weight with the norm folded in; the reference normalises first."""
    if not prenorm:
        x = rand(T, D)
        return x, x, lambda w: w
    x, norm_w = rand(T, D, scale=3), rand(D, scale=0.5)
    return x, native.rmsnorm(x, norm_w, 1e-6), lambda w: fused_gemm.fold_norm(w, norm_w)


def qkv_case(T, D, heads, kv_heads, dh, config, prenorm=False):
    x, xn, fold = inputs(T, D, prenorm)
    w = rand((heads + 2 * kv_heads) * dh, D, scale=D ** -0.5)
    pos = torch.randint(0, 2048, (T,), device=DEV)
    qw, kw = rand(dh, scale=0.5), rand(dh, scale=0.5)
    cos, sin = native.rope_table(10_000.0, dh, 2048, DEV)
    got = fused_gemm.qkv_norm_rope(x, fold(w), pos, qw, kw, cos, sin, heads, kv_heads, 1e-6, prenorm=prenorm,
                                   config=config)
    want = native.qk_norm_rope(xn @ w.T, pos, qw, kw, cos, sin, heads, kv_heads, 1e-6)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.is_contiguous()
        close(g, r)


def gate_up_case(T, D, I, config, prenorm=False):
    x, xn, fold = inputs(T, D, prenorm)
    w = rand(2 * I, D, scale=D ** -0.5 * 3)  # gate values of a few units: gelu's curved part and both tails
    got = fused_gemm.gate_up_gelu(x, fold(w), eps=1e-6, prenorm=prenorm, config=config)
    assert got.shape == (T, I)
    close(got, native.gelu_tanh_and_mul(xn @ w.T))


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("T", [1, 7, 130])
@pytest.mark.parametrize("D,heads,kv_heads,dh", [(64, 3, 1, 32), (100, 4, 2, 64), (128, 2, 2, 32)])
def test_qkv_norm_rope(T, D, heads, kv_heads, dh, prenorm):
    """D=100 ends in a partial K tile; T=130 in a partial row tile."""
    qkv_case(T, D, heads, kv_heads, dh, FIXED, prenorm)


@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("T", [1, 7, 130])
@pytest.mark.parametrize("D,I", [(64, 64), (100, 200), (128, 48)])
def test_gate_up_gelu(T, D, I, prenorm):
    """I=200 and 48 end in a partial column tile."""
    gate_up_case(T, D, I, FIXED, prenorm)


@pytest.mark.parametrize("prenorm", [False, True])
def test_gemma_shapes(prenorm):
    """EmbeddingGemma's own shapes: D=768, 3 heads + 1 kv head of 256 (qkv N=1280), I=1152 (gate_up N=2304)."""
    qkv_case(3, 768, 3, 1, 256, FIXED, prenorm)
    gate_up_case(3, 768, 1152, FIXED, prenorm)


@pytest.mark.skipif(not CUDA, reason="autotuning times kernels on a GPU")
@pytest.mark.parametrize("T", [16, 1024])  # one tuning regime each, compiled for the benchmark too (disk cache)
def test_autotuned(T):
    for prenorm in (False, True):
        qkv_case(T, 768, 3, 1, 256, None, prenorm)
        gate_up_case(T, 768, 1152, None, prenorm)
    assert fused_gemm.best_config("qkv_norm_rope", T) is not None
