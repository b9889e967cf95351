"""Shared fixtures: generated checkpoints (both tokenizer variants, a bare one), sentence-transformers
references, and a real tritonserver on the generated checkpoint."""
import os

if not os.path.exists("/dev/nvidiactl"):  # no GPU: Triton-lang kernels run in Triton's interpreter. Set before
    os.environ.setdefault("TRITON_INTERPRET", "1")  # anything imports triton, which reads it once.

import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the a of to and in is it for on with as was at by search result query text title none task "
         "kalo mine rusa tivo zequ than erin onst kami lovo").split()
UNICODE = ["Grüße aus Köln", "naïve café", "日本語のテキスト", "emoji 🚀🔥", "Ωmega ∑ ∫", "tab\tand\nnewline"]


def make_texts(n: int, max_words: int, seed: int = 0) -> list[str]:
    """n texts from 0 to max_words words (~1-2 tokens each), with unicode and literal special tokens mixed in."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(int(max_words * i / max(n - 1, 1)))]
        if i % 5 == 1:
            words.insert(rng.randint(0, len(words)), rng.choice(UNICODE))
        if i % 7 == 3:
            words.insert(rng.randint(0, len(words)), rng.choice(["<eos>", "<bos>", "<pad>", "<unk>"]))
        out.append(" ".join(words))
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for name, flags in {"eos": [], "noeos": ["--omit-eos"], "bare": ["--bare"]}.items():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(d / name), *flags],
                       check=True, stdout=subprocess.DEVNULL)
        out[name] = d / name
    return out


@pytest.fixture(scope="session")
def real_checkpoint() -> Path:
    p = os.environ.get("EMBEDDINGGEMMA_PATH")
    if not p:
        pytest.skip("EMBEDDINGGEMMA_PATH not set (CI sets it with ../shared/models/fetch-embeddinggemma.sh)")
    return Path(p)


_st_cache: dict = {}


def st_model(path: Path):
    from sentence_transformers import SentenceTransformer
    if path not in _st_cache:
        _st_cache[path] = SentenceTransformer(str(path), device="cpu")
    return _st_cache[path]


def st_ids(model, texts: list[str], **kw) -> list[list[int]]:
    """Token ids exactly as sentence-transformers builds them (prompt kwargs as for encode)."""
    prompt = kw.get("prompt")
    if kw.get("prompt_name"):
        prompt = model.prompts[kw["prompt_name"]]
    f = model.tokenize([(prompt or "") + t for t in texts])
    return [r[:int(m.sum())].tolist() for r, m in zip(f["input_ids"], f["attention_mask"])]


def st_embed_ids(model, seqs: list[list[int]]) -> np.ndarray:
    """sentence-transformers' modules (Transformer, Pooling, Dense, Normalize) on given id sequences."""
    out = []
    for s in seqs:  # one at a time: no padding, nothing to differ by
        feats = {"input_ids": torch.tensor([s]), "attention_mask": torch.ones(1, len(s), dtype=torch.long),
                 "modality": "text"}
        with torch.inference_mode():
            out.append(model(feats)["sentence_embedding"][0].float().numpy())
    return np.stack(out)


def eos_added(model) -> bool:
    return model.tokenizer("a")["input_ids"][-1] == model.tokenizer.eos_token_id


def expected_ids(model, texts: list[str], **kw) -> list[list[int]]:
    """sentence-transformers' ids, with EOS appended (truncating to keep it last) where its tokenizer omits it."""
    ids = st_ids(model, texts, **kw)
    if eos_added(model):
        return ids
    return [s[:model.max_seq_length - 1] + [model.tokenizer.eos_token_id] for s in ids]


def reference(path: Path, texts: list[str], **kw) -> np.ndarray:
    """What a served embedding must equal: SentenceTransformer.encode; for a checkpoint whose tokenizer omits
    EOS, the same modules on `expected_ids`."""
    m = st_model(path)
    if eos_added(m):
        return m.encode(texts, convert_to_numpy=True, **kw)
    return st_embed_ids(m, expected_ids(m, texts, **kw))


@pytest.fixture(scope="session")
def server(checkpoints, tmp_path_factory):
    from egemma.server import TritonServer, free_port
    d = tmp_path_factory.mktemp("server")
    with open(d / "tritonserver.log", "w") as log, \
            TritonServer(checkpoints["eos"], http_port=free_port(), grpc_port=free_port(),
                         metrics_port=free_port(), run_dir=d, log_file=log, ready_timeout=300,
                         params={"matryoshka_dims": "48,32,16"}) as s:
        yield s
