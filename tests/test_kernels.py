"""Each fused op against its torch-native reference on odd sizes, residual on and off, fresh random data.
On CPU the Triton-lang kernels run in Triton's interpreter (fp32); on a GPU host in bf16, plus sgl-kernel."""
import pytest
import torch

CUDA = torch.cuda.is_available()  # without one, conftest.py put Triton in interpreter mode
pytest.importorskip("triton")

from egemma.engine import select  # noqa: E402
from egemma.kernels import fused_gemm, native, triton_ops  # noqa: E402
from egemma.engine.select import available_norm_backends, make_ops  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 2e-2 if CUDA else 1e-5  # bf16 outputs carry ~3 significant digits
SIZES = [1, 7, 769]


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(DTYPE)


def close(a, b):
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    assert ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item() <= TOL


def impls(op):
    if not CUDA:
        return [getattr(triton_ops, op)]
    return [getattr(make_ops(b, DEV), op) for b in available_norm_backends(DEV) if b != "native"]


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("D", [768, 100])
def test_embed(T, D):
    """The gather, the scale rounded to the table's dtype as transformers does, and each row's rstd."""
    table = rand(1000, D, scale=0.05)
    ids = torch.randint(0, 1000, (T,), device=DEV)
    scale = torch.tensor(D ** 0.5, dtype=DTYPE)
    (h, r), (h_want, r_want) = triton_ops.embed(ids, table, scale, 1e-6), native.embed(ids, table, scale, 1e-6)
    assert h.dtype == DTYPE and r.dtype == torch.float32
    close(h, h_want)
    close(r, r_want)


@pytest.mark.parametrize("T", SIZES)
def test_norm_add_norm_updates_residual_in_place(T):
    for f in impls("norm_add_norm"):
        x, r = rand(T, 768, scale=3), rand(T, 768, scale=10)
        w_post, w_pre = rand(768, scale=0.5), rand(768, scale=0.5)
        r1, r2 = r.clone(), r.clone()
        got = f(x.clone(), r1, w_post, w_pre, 1e-6)
        want = native.norm_add_norm(x.clone(), r2, w_post, w_pre, 1e-6)
        close(r1, r2)
        close(got, want)


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("D", [768, 100])
def test_norm_add_rstd_updates_residual_in_place(T, D):
    x, r, w_post = rand(T, D, scale=3), rand(T, D, scale=10), rand(D, scale=0.5)
    r1, r2 = r.clone(), r.clone()
    got = triton_ops.norm_add_rstd(x.clone(), r1, w_post, 1e-6)
    want = native.norm_add_rstd(x.clone(), r2, w_post, 1e-6)
    assert got.dtype == want.dtype == torch.float32 and got.shape == (T,)
    close(r1, r2)
    close(got, want)


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("I", [1152, 200])  # Gemma's, and one that ends in a partial column block
def test_gelu_tanh_and_mul(T, I):
    for f in impls("gelu_tanh_and_mul"):
        gu = rand(T, 2 * I, scale=4)
        close(f(gu), native.gelu_tanh_and_mul(gu))


# On CPU (Triton's interpreter, fp32: its TMA loads of bf16 come back wrong) small shapes and tiles, so that it runs
# in seconds; on the GPU Gemma's shapes with every candidate tile, and mlp_up's paths chosen per token bucket.
GATE_UP = [(1, 768, 1152), (37, 768, 1152), (769, 768, 1152), (300, 96, 200)] if CUDA else \
    [(1, 96, 80), (37, 96, 80), (130, 64, 200)]
TILES = fused_gemm.TILES if CUDA else (fused_gemm.Tile(16, 32, 32, 2, 4), fused_gemm.Tile(32, 64, 64, 2, 4))


@pytest.mark.parametrize("T,D,I", GATE_UP)
def test_gate_up_gelu(T, D, I):
    """Every tile, with and without a row scale (the folded norm's)."""
    x, w = rand(T, D, scale=3), rand(2 * I, D, scale=D ** -0.5)
    rstd = torch.rand(T, device=DEV) + 0.5
    want, want_scaled = native.gate_up_gelu(x, w), native.gate_up_gelu(x, w, rstd)
    for tile in TILES:
        close(fused_gemm.gate_up_gelu(x, w, tile), want)
        close(fused_gemm.gate_up_gelu(x, w, tile, rstd), want_scaled)


@pytest.mark.parametrize("T,D,I", GATE_UP)
def test_mlp_up(T, D, I):
    """The row-scale norm + each fused tile, each backend's unfused mlp_up (its norm_add_norm with a unit pre-norm,
    cuBLAS, gelu), and on the GPU mlp_up with a path per token bucket, against native.mlp_up, the residual updated
    alike."""
    x, r = rand(T, D, scale=3), rand(T, D, scale=10)
    w_post, w = rand(D, scale=0.5), rand(2 * I, D, scale=D ** -0.5)
    r_want = r.clone()
    want = native.mlp_up(x.clone(), r_want, w_post, w, 1e-6)
    cands = [select._fused(t, triton_ops.norm_add_rstd) for t in TILES] + [
        make_ops(b, DEV, DTYPE, D, det).mlp_up for b in available_norm_backends(DEV) for det in (0, 1)]
    if CUDA:
        names = [select.UNFUSED, str(TILES[0]), str(TILES[-1])]
        cands.append(select.build_ops({"norm_add_norm": "triton", "gelu_tanh_and_mul": "triton"}, names, DEV, DTYPE, D,
                                      [16, 64, 1024]).mlp_up)
    for f in cands:
        r_got = r.clone()
        close(f(x.clone(), r_got, w_post, w, 1e-6), want)
        close(r_got, r_want)


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("heads,kv_heads,dh", [(3, 1, 256), (3, 1, 16), (4, 2, 64), (6, 3, 32)])  # v: 96 wide
def test_qk_norm_rope(T, heads, kv_heads, dh):
    qkv = rand(T, (heads + 2 * kv_heads) * dh, scale=2)
    pos = torch.randint(0, 2048, (T,), device=DEV)
    qw, kw = rand(dh, scale=0.5), rand(dh, scale=0.5)
    cos, sin = native.rope_table(10_000.0, dh, 2048, DEV)
    rstd = torch.rand(T, device=DEV) * 1e-3 + 2e-4  # eps / rstd^2 0.7 to 25: q and k's norms feel it
    got = triton_ops.qk_norm_rope(qkv, pos, qw, kw, cos, sin, heads, kv_heads, 1e-6, rstd)
    want = native.qk_norm_rope(qkv, pos, qw, kw, cos, sin, heads, kv_heads, 1e-6, rstd)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        close(g, w)


@pytest.mark.parametrize("lengths", [[1], [7, 0, 130], [769, 3, 64, 1], [4099, 2]])  # the last: large-batch tile
@pytest.mark.parametrize("D", [768, 100])
def test_mean_pool(lengths, D):
    """As inside a CUDA graph: empty sequences, and padding rows after the last sequence that hold NaN."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    x = rand(int(cu[-1]) + 5, D, scale=3)
    x[int(cu[-1]):] = float("nan")
    got = triton_ops.mean_pool(x, cu, len(lengths))
    want = native.mean_pool(x, cu, len(lengths))
    assert got.dtype == want.dtype == torch.float32 and got.shape == (len(lengths), D)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5  # both sum in fp32
    for i, n in enumerate(lengths):
        ref = x[int(cu[i]):int(cu[i + 1])].float().mean(0) if n else torch.zeros(D, device=DEV)
        assert torch.allclose(want[i], ref, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="the interpreter has no warps: every launch shape sums alike there")
@pytest.mark.parametrize("backend", ["triton", "sgl-kernel"])
def test_deterministic_ops_give_a_row_the_same_bits_in_any_batch(backend):
    """The ops of a deterministic engine (build_ops(deterministic=True)): a row among 7 rows and among 5000 (past 4096,
    where the size-dependent launch shapes switch) has the same bits, as does a sequence's mean."""
    if backend not in available_norm_backends(DEV):
        pytest.skip(f"{backend} not installed")
    ops, big, few, D = make_ops(backend, DEV, DTYPE, 768, deterministic=True), 5000, 7, 768
    x, r, w, qkv = rand(big, D, scale=3), rand(big, D, scale=10), rand(D, scale=0.5), rand(1, 1280)
    for f in (lambda T: ops.norm_add_rstd(x[:T].clone(), r[:T].clone(), w, 1e-6),
              lambda T: ops.norm_add_norm(x[:T].clone(), r[:T].clone(), w, w, 1e-6),
              lambda T: ops.embed(torch.arange(T, device=DEV) % 1000, x[:1000].contiguous(), 27.7, 1e-6)[1],
              lambda T: ops.qk_norm_rope(qkv.expand(T, 1280).contiguous(), torch.zeros(T, dtype=torch.long,
                                         device=DEV), w[:256], w[:256], *native.rope_table(1e4, 256, 8, DEV), 3, 1,
                                         1e-6, torch.ones(T, device=DEV))[0],
              lambda T: ops.mean_pool(x[:T], torch.tensor([0, 5, T], dtype=torch.int32, device=DEV), 2)[:1]):
        assert torch.equal(f(big)[:few], f(few)[:few])


@pytest.mark.parametrize("lengths", [[5, 9], [1, 20, 7]])  # 20: |i - j| up to 19, past the small window's 16
def test_layer_stack_matches_the_layered_forward(checkpoints, lengths):
    """egemma/kernels/layer_stack.py against Encoder.forward, in the CUDA graphs' batch layout (the padding one more
    sequence, unused slots empty). CPU: the interpreter, a launch a phase, fp32, native ops; GPU: bf16, one launch
    with grid barriers, the same as a launch a phase bit for bit."""
    from egemma.engine.config import ModelConfig
    from egemma.engine.model import Encoder, Packed
    model = Encoder(ModelConfig.load(checkpoints["eos"]), DTYPE, DEV)
    n = sum(lengths)
    t = 16 if n <= 16 else 32
    ids = torch.cat([torch.randint(4, model.cfg.vocab_size, (n,)), torch.zeros(t - n, dtype=torch.long)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist(), n, n, t], dtype=torch.int32)
    pos = torch.cat([torch.arange(k) for k in lengths] + [torch.zeros(t - n, dtype=torch.long)])
    b = Packed(ids.to(DEV), pos.to(DEV), cu.to(DEV), t)
    ops = make_ops("triton" if CUDA else "native", DEV, DTYPE, model.cfg.hidden)
    attn = (select.attention_fn("fa2" if CUDA else "native"),) * 2
    got = model.forward_stack(b, ops)
    want = model.forward(b, ops, attn)[:n].float()
    if CUDA:
        assert torch.equal(got, model.forward_stack(b, ops, sync=False))
        assert torch.nn.functional.cosine_similarity(got[:n].float(), want).min().item() >= 0.999
    else:
        close(got[:n], want)
