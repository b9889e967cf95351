"""The engine (no Triton) against sentence-transformers in fp32 on CPU, and strict checkpoint loading."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import assert_close, make_texts, reference, st_embed_ids, st_model
from egemma.engine.config import CheckpointError, ModelConfig
from egemma.engine import Engine, EngineConfig
from egemma.engine.tokenizer import TextTokenizer


def embed_texts(ckpt, texts, **ec):
    eng = Engine(EngineConfig(str(ckpt), **ec))
    tok = TextTokenizer(eng.cfg)
    seqs = tok.encode(texts)
    return eng.embed(seqs), [len(s) for s in seqs]


@pytest.mark.parametrize("variant", ["eos", "noeos"])
def test_parity_with_sentence_transformers(checkpoints, variant):
    texts = make_texts(24, 520)
    ours, lengths = embed_texts(checkpoints[variant], texts)
    assert min(lengths) <= 3 and max(lengths) >= 600  # 1 ... 600 tokens; the window is +-16
    assert_close(ours, reference(checkpoints[variant], texts))


def test_bare_checkpoint_is_mean_pooled_like_sentence_transformers(checkpoints):
    texts = make_texts(6, 100)
    ours, _ = embed_texts(checkpoints["bare"], texts)
    ref = st_model(checkpoints["bare"]).encode(texts, convert_to_numpy=True)
    assert ours.shape[1] == 48
    assert_close(ours, ref)


def test_batches_split_over_max_tokens_give_the_same_numbers(checkpoints):
    texts = make_texts(30, 500, seed=3)
    whole, lengths = embed_texts(checkpoints["eos"], texts)
    split, _ = embed_texts(checkpoints["eos"], texts, max_tokens=2048, max_seqs=3)
    assert sum(lengths) > 4 * 2048
    assert_close(split, whole, tol=1e-6)


def test_window_is_per_sequence_and_two_sided(checkpoints):
    """Sequences straddling the window, packed together, equal each one alone and sentence-transformers."""
    eng = Engine(EngineConfig(str(checkpoints["eos"])))
    rng = np.random.default_rng(0)
    seqs = [np.concatenate([[2], rng.integers(4, 1000, n - 2), [1]]).astype(np.int32) for n in (30, 33, 17, 500)]
    packed = eng.embed(seqs)
    alone = np.concatenate([eng.embed([s]) for s in seqs])
    ref = st_embed_ids(st_model(checkpoints["eos"]), [s.tolist() for s in seqs])
    assert_close(packed, alone, tol=1e-6)
    assert_close(packed, ref)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("biased", [("2_Dense", "3_Dense"), ("2_Dense",), ("3_Dense",)])
def test_dense_chain_with_biases_is_multiplied_out_like_sentence_transformers(checkpoints, tmp_path, biased):
    """The Dense layers become one affine map at load (egemma.engine.model.Head): with a bias on either or both, as
    sentence-transformers' Dense can have."""
    ck = _copy(checkpoints["eos"], tmp_path / "bias")
    for i, sub in enumerate(biased):
        cfg = json.loads((ck / sub / "config.json").read_text())
        w = load_file(ck / sub / "model.safetensors")
        w["linear.bias"] = torch.linspace(-0.5, 0.5 + i, cfg["out_features"])
        save_file(w, ck / sub / "model.safetensors")
        (ck / sub / "config.json").write_text(json.dumps({**cfg, "bias": True}))
    texts = make_texts(5, 60)
    ours, _ = embed_texts(ck, texts)
    assert_close(ours, reference(ck, texts))
    plain, _ = embed_texts(checkpoints["eos"], texts)
    assert np.abs(ours - plain).max() > 0.01  # the biases moved the embeddings


def test_missing_or_unexpected_weight_fails_loudly(checkpoints, tmp_path):
    ck = _copy(checkpoints["eos"], tmp_path / "a")
    w = load_file(ck / "model.safetensors")
    del w["layers.3.mlp.up_proj.weight"]
    w["layers.3.mlp.extra.weight"] = w["norm.weight"].clone()
    save_file(w, ck / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.3\.mlp\.up_proj\.weight.*layers\.3\.mlp\.extra\.weight"):
        Engine(EngineConfig(str(ck)))


def test_missing_dense_projector_fails_loudly(checkpoints, tmp_path):
    ck = _copy(checkpoints["eos"], tmp_path / "b")
    (ck / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="2_Dense"):
        Engine(EngineConfig(str(ck)))


def test_wrong_shape_and_bad_config_fail_loudly(checkpoints, tmp_path):
    ck = _copy(checkpoints["eos"], tmp_path / "c")
    w = load_file(ck / "model.safetensors")
    w["norm.weight"] = w["norm.weight"][:-1].clone()
    save_file(w, ck / "model.safetensors")
    with pytest.raises(CheckpointError, match="norm.weight has shape"):
        Engine(EngineConfig(str(ck)))
    cfg = json.loads((ck / "config.json").read_text())
    cfg["use_bidirectional_attention"] = False
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="bidirectional"):
        ModelConfig.load(ck)
    (ck / "config.json").write_text(json.dumps({**cfg, "use_bidirectional_attention": True}))
    dense = json.loads((ck / "2_Dense" / "config.json").read_text())
    del dense["activation_function"]  # sentence-transformers' default, Tanh, which the head does not apply
    (ck / "2_Dense" / "config.json").write_text(json.dumps(dense))
    with pytest.raises(CheckpointError, match="Tanh"):
        ModelConfig.load(ck)
    with pytest.raises(ValueError, match="fp16"):
        Engine(EngineConfig(str(checkpoints["eos"]), dtype="float16"))
    with pytest.raises(RuntimeError, match="not available"):
        Engine(EngineConfig(str(checkpoints["eos"]), attention_backend="fa3"))


def test_engine_rejects_bad_ids(checkpoints):
    eng = Engine(EngineConfig(str(checkpoints["eos"])))
    assert eng.check(np.array([2, 5, 1])) is None
    assert "vocabulary" in eng.check(np.array([2, 5000, 1]))
    assert "vocabulary" in eng.check(np.array([2, -1, 1]))
    assert "non-empty" in eng.check(np.array([], dtype=np.int32))
    assert "positions" in eng.check(np.ones(4, dtype=np.int32), longest=2049)
    assert "positions" in eng.check(np.ones(2049, dtype=np.int32))


def test_engine_config_from_model_parameters(checkpoints):
    ec = EngineConfig.from_params(str(checkpoints["eos"]), {"cuda_graphs": "false", "max_tokens": "4096",
                                                            "attention_backend": "native"})
    assert (ec.cuda_graphs, ec.max_tokens, ec.attention_backend) == (False, 4096, "native")
    with pytest.raises(ValueError, match="unknown encoder parameters.*colour"):
        EngineConfig.from_params(str(checkpoints["eos"]), {"colour": "red"})
    with pytest.raises(ValueError, match="max_tokens"):
        Engine(EngineConfig(str(checkpoints["eos"]), max_tokens=1024))  # below max_seq_length 2048


def test_rendered_repository_takes_parameters_and_instance_counts(checkpoints, tmp_path):
    """What `serve --param / --instances` write into the served copy of model_repository (the source stays)."""
    from egemma.ops.repository import REPO, render_repository
    source = (REPO / "embeddinggemma_encoder" / "config.pbtxt").read_text()
    repo = render_repository(tmp_path / "repo", checkpoints["eos"], {"attention_backend": "fa2"},
                             instances={"embeddinggemma_encoder": 2})
    enc = (repo / "embeddinggemma_encoder" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 2 kind: KIND_MODEL } ]" in enc
    assert 'key: "attention_backend" value: { string_value: "fa2" }' in enc
    assert f'string_value: "{checkpoints["eos"]}"' in (repo / "embeddinggemma_tokenizer" / "config.pbtxt").read_text()
    assert (REPO / "embeddinggemma_encoder" / "config.pbtxt").read_text() == source
    with pytest.raises(ValueError, match="models"):
        render_repository(tmp_path / "r2", checkpoints["eos"], instances={"nope": 2})
    with pytest.raises(ValueError, match="colour"):
        render_repository(tmp_path / "r3", checkpoints["eos"], {"colour": "red"})
