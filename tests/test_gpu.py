"""GPU engine (bf16, fused kernels, FA3/FA2, CUDA graphs) against the fp32 reference: sentence-transformers
(transformers' Gemma3, bidirectional) on the same full-size random-weight checkpoint. GPU host only:
EGEMMA_FULL_CHECKPOINT names a `make_checkpoint.py --full-size` directory (perf/gpu_run.sh makes one)."""
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def full():
    p = os.environ.get("EGEMMA_FULL_CHECKPOINT")
    if not p:
        pytest.skip("EGEMMA_FULL_CHECKPOINT not set")
    from egemma.engine import Engine, EngineConfig
    from sentence_transformers import SentenceTransformer
    eng = Engine(EngineConfig(p))
    ref = SentenceTransformer(p, device="cuda")  # fp32, TF32 off (torch's default for matmul)
    return eng, ref


def reference(st, seqs):
    out = []
    with torch.inference_mode():
        for s in seqs:
            ids = torch.tensor([s.tolist()], device="cuda")
            f = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "modality": "text"}
            out.append(st(f)["sentence_embedding"][0].float().cpu().numpy())
    return np.stack(out)


def random_seqs(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [np.concatenate([[2], rng.integers(4, vocab, n - 2), [1]]).astype(np.int32) if n > 1
            else np.array([2], dtype=np.int32) for n in lengths]


def cos(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_bf16_engine_matches_fp32_reference_in_varying_batches(full):
    eng, st = full
    rng = np.random.default_rng(1)
    lengths = [1, 2, 16, 255, 256, 257, 258, 513, 1024, 2047, 2048] + rng.integers(2, 2049, 45).tolist()
    seqs = random_seqs(lengths, eng.cfg.vocab_size)
    ref = reference(st, seqs)
    got, i = [], 0
    for size in (1, 3, 7, 13, 32):  # varying batch compositions, all through graph replay
        while i < len(seqs) and size:
            got.append(eng.embed(seqs[i:i + size]))
            i += size
            size = 0
    got.append(eng.embed(seqs[i:]))
    got = np.concatenate(got)
    c = cos(got, ref)
    print(f"min cosine {c.min():.6f}, mean {c.mean():.6f} over {len(seqs)} sequences")
    assert eng.stats["graph_replays"] > 0
    assert c.min() >= 0.999


def test_graph_replay_equals_eager_bit_for_bit(full):
    eng, _ = full
    seqs = random_seqs([300, 513, 2048, 17, 5], eng.cfg.vocab_size, seed=2)
    ids = np.concatenate(seqs)
    lengths = [len(s) for s in seqs]
    g, replayed = eng.graphs.run(ids, lengths, use_graph=True)
    e, eager_replayed = eng.graphs.run(ids, lengths, use_graph=False)
    assert replayed and not eager_replayed
    assert np.array_equal(g, e)


def test_window_straddling_batch_is_per_sequence_and_two_sided(full):
    eng, st = full
    seqs = random_seqs([300, 513, 2048], eng.cfg.vocab_size, seed=3)
    packed = eng.embed(seqs)
    alone = np.concatenate([eng.embed([s]) for s in seqs])
    ref = reference(st, seqs)
    assert cos(packed, ref).min() >= 0.999
    assert cos(packed, alone).min() >= 0.9999
