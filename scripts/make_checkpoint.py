#!/usr/bin/env python3
"""Generate an EmbeddingGemma-layout checkpoint with random weights (sentence-transformers layout:
config.json, model.safetensors, tokenizer files, 1_Pooling/, 2_Dense/, 3_Dense/, modules.json, ...).

  make_checkpoint.py DEST                 the demo (what scripts/serve.sh serves without a model): a small
                                          backbone (6 layers, hidden 48, window +-16) with the real checkpoint's
                                          answers' shapes: Dense 48 -> 3072 -> 768, so 768-dim embeddings and
                                          Matryoshka sizes 768/512/256/128, the real prompts; trained tokenizer
  make_checkpoint.py DEST --small         the tests' model: the same backbone with a 48-wide head (48 -> 192 -> 48)
  make_checkpoint.py DEST --omit-eos      either, with a tokenizer that adds BOS but not EOS
  make_checkpoint.py DEST --full-size     the real checkpoint's layout: its shapes (24 layers, hidden 768, vocab
                                          262144), tensor names and dtypes (fp32, ~1.2 GB), the 2_Dense / 3_Dense
                                          folders and config_sentence_transformers.json with its prompts (checked
                                          against google/embeddinggemma-300m), for benchmarks and boot timing
  make_checkpoint.py DEST --bare          no sentence-transformers files (a bare Gemma3 checkpoint)

The tokenizer is a BPE trained here with `tokenizers` on generated text, with Gemma's special ids
(pad 0, eos 1, bos 2, unk 3, mask 4). Deterministic for a given --seed. Every checkpoint made here holds
egemma.engine.config.DEMO_MARKER, which makes the server say in its answers and its log that it is a demo."""
import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from egemma.engine import weights
from egemma.engine.config import DEMO_MARKER, ModelConfig
from egemma.ops.repository import demo_marker

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Gemma's ids 0-4
PROMPTS = {  # as in google/embeddinggemma-300m
    "query": "task: search result | query: ", "document": "title: none | text: ",
    "BitextMining": "task: search result | query: ", "Clustering": "task: clustering | query: ",
    "Classification": "task: classification | query: ", "InstructionRetrieval": "task: code retrieval | query: ",
    "MultilabelClassification": "task: classification | query: ",
    "PairClassification": "task: sentence similarity | query: ", "Reranking": "task: search result | query: ",
    "Retrieval": "task: search result | query: ", "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ", "STS": "task: sentence similarity | query: ",
    "Summarization": "task: summarization | query: "}
SMALL = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=6, num_attention_heads=3,
             num_key_value_heads=1, head_dim=16, sliding_window=32, _sliding_window_pattern=3, vocab_size=1024)
REAL_DENSE = (3072, 768)  # google/embeddinggemma-300m's projector: 768 -> 3072 -> 768
FULL = dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=24, num_attention_heads=3,
            num_key_value_heads=1, head_dim=256, sliding_window=512, _sliding_window_pattern=6, vocab_size=262144)


def corpus(rng: random.Random, n: int = 4000) -> list[str]:
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "qu", "th", "an", "er", "in", "on", "st"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(600)]
    words += "the a of to and in is it for on with as was at by search result query text title none task".split()
    extra = ["Grüße aus Köln", "naïve café", "日本語のテキスト", "emoji 🚀🔥", "Ωmega ∑ ∫", "tab\tand\nnewline"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) for _ in range(n)]
    return lines + extra * 20 + list(PROMPTS.values()) * 20


def train_tokenizer(vocab_size: int, add_eos: bool, rng: random.Random) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Replace("▁", " ")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus(rng), trainer=trainer)
    # Gemma's byte fallback: a <0xXX> token for every byte, so characters never seen in training still tokenise
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    d["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(d))
    single = "<bos> $A <eos>" if add_eos else "<bos> $A"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<bos>", 2), ("<eos>", 1)])
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    return tok


def write_tokenizer(dest: Path, tok: Tokenizer, omit_eos: bool):
    """tokenizer.json plus the GemmaTokenizer config files around it (ids beyond the trained vocabulary are
    reachable as token ids only; full-size checkpoints use them in benchmarks)."""
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GemmaTokenizer", "add_bos_token": True, "add_eos_token": not omit_eos,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": 2048, "padding_side": "right", "clean_up_tokenization_spaces": False}, indent=2))
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}, indent=2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--full-size", action="store_true", help="real EmbeddingGemma shapes")
    size.add_argument("--small", action="store_true", help="a 48-wide head (the tests' model) in place of the "
                                                           "demo's 768-wide one")
    ap.add_argument("--omit-eos", action="store_true", help="tokenizer config that does not append EOS")
    ap.add_argument("--bare", action="store_true", help="no sentence-transformers modules")
    ap.add_argument("--tokenizer-from", type=Path, metavar="DIR",
                    help="copy tokenizer.json / tokenizer_config.json / special_tokens_map.json from DIR "
                         "(e.g. the real checkpoint) instead of training one")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    shape = FULL if a.full_size else SMALL
    if a.dest.exists():
        shutil.rmtree(a.dest)
    a.dest.mkdir(parents=True)

    n, L = shape["num_hidden_layers"], shape["_sliding_window_pattern"]
    config = {
        "architectures": ["Gemma3TextModel"], "model_type": "gemma3_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": 0.02, "max_position_embeddings": 2048, "query_pre_attn_scalar": shape["head_dim"],
        "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
        "use_bidirectional_attention": True, "use_cache": True, "dtype": "float32",
        "layer_types": ["full_attention" if (i + 1) % L == 0 else "sliding_attention" for i in range(n)],
        **shape}
    (a.dest / "config.json").write_text(json.dumps(config, indent=2))

    D = shape["hidden_size"]
    inner, out = (4 * D, D) if a.small else REAL_DENSE

    def lin(o, i):  # random weights at a scale that keeps activations O(1) through the layers
        return torch.randn(o, i) / i ** 0.5

    def nw(d):
        return 0.3 * torch.randn(d)

    def init(name, dims):
        if name == "embed_tokens.weight":
            return torch.randn(*dims) * 0.05
        return lin(*dims) if len(dims) == 2 else nw(*dims)

    w = {name: init(name, dims) for name, dims in weights.expected(ModelConfig.load(a.dest)).items()}
    save_file({k: v.contiguous() for k, v in w.items()}, str(a.dest / "model.safetensors"), metadata={"format": "pt"})

    if a.tokenizer_from:
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy2(a.tokenizer_from / f, a.dest / f)
    else:
        write_tokenizer(a.dest, train_tokenizer(1024, not a.omit_eos, rng), a.omit_eos)
    (a.dest / DEMO_MARKER).write_text(json.dumps(demo_marker(), indent=2))
    if a.bare:
        print(a.dest)
        return

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"},
               {"idx": 4, "name": "4", "path": "4_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (a.dest / "modules.json").write_text(json.dumps(modules, indent=2))
    (a.dest / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048, "do_lower_case": False}))
    (a.dest / "config_sentence_transformers.json").write_text(json.dumps(
        {"model_type": "SentenceTransformer", "prompts": PROMPTS, "default_prompt_name": None,
         "similarity_fn_name": "cosine"}, indent=2))
    (a.dest / "1_Pooling").mkdir()
    (a.dest / "1_Pooling/config.json").write_text(json.dumps({
        "word_embedding_dimension": D, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True},
        indent=2))
    for sub, (i, o) in {"2_Dense": (D, inner), "3_Dense": (inner, out)}.items():
        (a.dest / sub).mkdir()
        (a.dest / sub / "config.json").write_text(json.dumps({
            "in_features": i, "out_features": o, "bias": False,
            "activation_function": "torch.nn.modules.linear.Identity"}, indent=2))
        save_file({"linear.weight": lin(o, i).contiguous()}, str(a.dest / sub / "model.safetensors"))
    print(a.dest)


if __name__ == "__main__":
    sys.exit(main())
