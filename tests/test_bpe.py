"""egemma/kernels/bpe.c, our C tokenizer, against its reference, Hugging Face `tokenizers` on the same tokenizer.json:
the same ids for every text, one at a time and as parallel batches, cold and from its word cache."""
import json
import os
import random
import shutil
import subprocess
import sys
import warnings

import pytest
from tokenizers import Tokenizer

from helpers import ROOT, UNICODE, make_texts, wait_for
from test_tokenizer import EDGE, ODD, glued_bpe
from egemma.engine.chunker import Chunker
from egemma.engine.config import ModelConfig
from egemma.engine.process import cache_dir
from egemma.engine.tokenizer import TextTokenizer, resolved_tokenizer_json
from egemma.kernels import bpe


@pytest.fixture(scope="module", autouse=True)
def compiler():
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        if os.environ.get("CI"):
            pytest.fail("no C compiler: egemma/kernels/bpe.c cannot be built, and CI must test it")
        pytest.skip("no C compiler to build egemma/kernels/bpe.c")


def with_bytes(raw: str) -> str:
    """The tokenizer with every <0xXX> byte token (a trained BPE has only those it saw), as Gemma's has."""
    d = json.loads(raw)
    vocab = d["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return json.dumps(d)


def c_bpe(raw: str, threads: int = 0) -> bpe.Bpe:
    d, tok = json.loads(raw), Tokenizer.from_str(raw)
    return bpe.Bpe(d, bpe.added_ids(tok), Chunker(raw).glued, threads, cache_dir())


def tricky(raw: str, rng: random.Random, n: int) -> list[str]:
    """Texts built to reach every path: spaces and "▁" (the normaliser; where words are cut), characters glued
    to "▁", whole added tokens and their fragments, characters without a token (byte fallback), multi-byte and
    control characters, and runs long enough to bypass the word cache (over 50 bytes) or to collide in it."""
    d = json.loads(raw)
    vocab = d["model"]["vocab"]
    added = [a["content"] for a in d["added_tokens"]][:50]
    nochar = [c for c in "\x00\x7f\u0378𝔘𠀀\U000e0001\ufffe\u2581" if c not in vocab]
    alphabet = list(ODD + "  ▁▁<>/\n\t.,'\"aeiou") + nochar + [a[:2] for a in added]
    words = list({w for t in make_texts(40, 60, seed=1) for w in t.split()})
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            parts.append(rng.choice(added) if r < 0.05 and added else rng.choice(words) if r < 0.5 else
                         rng.choice(alphabet) * rng.choice((1, 1, 1, 2, 7, 30)))
        out.append(rng.choice(("", " ")).join(parts))
    return out


def same_ids(raw: str, texts: list[str], threads: int = 3):
    """One text at a time, cold and from the cache, then all together over the pool, cut into pieces of about 1
    byte (every safe cut taken), 64 and 2048."""
    hf = Tokenizer.from_str(raw)
    want = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    b = c_bpe(raw, threads)
    for cold_or_cached in range(2):
        one = [b.encode([t])[0].tolist() for t in texts]
        assert one == want, [t for t, x, y in zip(texts, one, want) if x != y][:3]
    for chunk in (1, 64, 2048):
        batch = [x.tolist() for x in b.encode(texts, chunk)]
        assert batch == want, (chunk, [t for t, x, y in zip(texts, batch, want) if x != y][:3])


@pytest.mark.parametrize("source", ["checkpoint", "glued"])
def test_ids_equal_tokenizers(checkpoints, source):
    raw = with_bytes(glued_bpe()) if source == "glued" else resolved_tokenizer_json(checkpoints["eos"])
    assert bpe.why_not(json.loads(raw)) is None
    rng = random.Random(0)
    texts = EDGE + UNICODE + make_texts(40, 400) + tricky(raw, rng, 3000)
    texts += ["".join(rng.choice(ODD) for _ in range(rng.randint(0, 300))) for _ in range(1000)]
    same_ids(raw, texts)


def test_real_tokenizer_ids_equal_tokenizers(real_checkpoint):
    """Gemma's own tokenizer: 262k tokens, 515k merges, 6415 added tokens."""
    raw = resolved_tokenizer_json(real_checkpoint)
    rng = random.Random(0)
    texts = EDGE + UNICODE + tricky(raw, rng, 3000) + [" ".join(make_texts(60, 300, seed=s)) for s in range(20)]
    texts += ["<start_of_turn>user\n" + t + "<end_of_turn>\n<start_of_turn>model\n" for t in make_texts(30, 50)]
    same_ids(raw, texts, threads=5)


def test_text_tokenizer_backends_agree(checkpoints):
    """The Triton tokenizer's two backends, truncation and pieces included; auto picks C where it can."""
    cfg = ModelConfig.load(checkpoints["eos"])
    c, hf = TextTokenizer(cfg, backend="c"), TextTokenizer(cfg, backend="tokenizers")
    assert (c.backend, hf.backend, TextTokenizer(cfg).backend) == ("c", "tokenizers", "c")
    texts = EDGE + make_texts(30, 2000) + tricky(resolved_tokenizer_json(checkpoints["eos"]), random.Random(1), 500)
    assert [s.tolist() for s in c.encode(texts)] == [s.tolist() for s in hf.encode(texts)]
    assert [c.untruncated_length(t) for t in texts[:50]] == [hf.untruncated_length(t) for t in texts[:50]]


def test_refuses_what_it_does_not_reproduce(checkpoints, tmp_path):
    """Every pipeline step the C code does not implement is named, and backend 'c' is then an error, not a
    silent other tokenizer; auto falls back to tokenizers, which gives the ids."""
    base = json.loads(with_bytes(glued_bpe()))
    cases = {
        "normaliser": lambda d: d.update(normalizer=None),
        "pre-tokenizer": lambda d: d.update(pre_tokenizer={"type": "ByteLevel", "add_prefix_space": True,
                                                           "trim_offsets": True, "use_regex": True}),
        "plain BPE": lambda d: d["model"].update(ignore_merges=True),
        "byte fallback": lambda d: d["model"]["vocab"].pop("<0x41>"),
        "added tokens": lambda d: d["added_tokens"][-1].update(normalized=True),
        "truncation": lambda d: d.update(truncation={"direction": "Right", "max_length": 2, "strategy":
                                                     "LongestFirst", "stride": 0}),
    }
    for why, change in cases.items():
        d = json.loads(json.dumps(base))
        change(d)
        assert why in bpe.why_not(d)
        with pytest.raises(bpe.Unsupported, match=why):
            bpe.Bpe(d, {}, set(), 0, cache_dir())
    cfg = ModelConfig.load(checkpoints["eos"])
    d = json.loads(resolved_tokenizer_json(checkpoints["eos"]))
    d["model"]["vocab"]["<0xA9>▁"] = len(d["model"]["vocab"])  # a merge on a byte-fallback token: "é" is <0xC3><0xA9>
    d["model"]["merges"].insert(0, ["<0xA9>", "▁"])
    assert Chunker(d).why_not == "merges of byte-fallback tokens"  # no cut after "é" is safe now
    f = tmp_path / "byte-merges.json"
    f.write_text(json.dumps(d))
    tok = TextTokenizer(cfg, str(f))
    assert tok.backend == "tokenizers"
    assert tok.encode(["é a"])[0].tolist()[1:-1] == Tokenizer.from_str(json.dumps(d)).encode("é a").ids[1:-1]
    d = json.loads(resolved_tokenizer_json(checkpoints["eos"]))
    d["model"]["ignore_merges"] = True
    f = tmp_path / "tokenizer.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="backend 'c' cannot serve"):
        TextTokenizer(cfg, str(f), backend="c")
    assert TextTokenizer(cfg, str(f)).backend == "tokenizers"
    with pytest.raises(ValueError, match="tokenizer backend 'rust'"):
        TextTokenizer(cfg, backend="rust")


def test_pieces_cost_linear_time_without_safe_cuts(checkpoints):
    """A 1 MB text with no safe cut (no spaces: CJK, say) is one piece, cut in one pass; ids as tokenizers'."""
    import time
    raw = resolved_tokenizer_json(checkpoints["eos"])
    b, hf = c_bpe(raw, 2), Tokenizer.from_str(raw)
    for text in ("日" * 330_000, "> " * 500_000):
        t0 = time.process_time()
        got = b.encode([text], 1024)[0]
        took = time.process_time() - t0
        assert got.tolist() == hf.encode(text, add_special_tokens=False).ids
        assert took < 5, took  # quadratic cutting took minutes on CI's cores; linear takes well under a second
    with pytest.raises(ValueError, match="chunk_bytes"):
        b.encode(["x"], 0)


def test_pool_threads_end_with_their_tokenizer_and_a_fork_tokenises_alone(checkpoints):
    import gc
    raw = resolved_tokenizer_json(checkpoints["eos"])
    texts = make_texts(64, 300)
    want = [e.ids for e in Tokenizer.from_str(raw).encode_batch(texts, add_special_tokens=False)]

    def tasks() -> set[str]:
        return set(os.listdir("/proc/self/task"))
    before = tasks()
    b = c_bpe(raw, 4)
    pool = tasks() - before
    assert len(pool) == 4
    with warnings.catch_warnings():  # forking with threads is what this checks (Python 3.12 warns of it)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child has none of the pool's threads: it must still answer, on its own thread
        ok = [x.tolist() for x in b.encode(texts, 64)] == want
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [x.tolist() for x in b.encode(texts, 64)] == want
    del b
    gc.collect()  # joined: each thread has exited, though the kernel may list it a moment longer
    wait_for(lambda: not pool & tasks(), 10, "the pool's threads to leave /proc")


def test_a_tokenizer_freed_as_soon_as_it_is_made_stops_its_pool(checkpoints):
    """bpe_free right after bpe_new, before the pool's threads have run: they must still see the stop. They once
    read the generation bpe_free had bumped, slept for a wake-up that never came, and bpe_free's join hung the
    process (the old code hung within 200 rounds here, every time). In a child, so that a hang fails the test."""
    code = f"""
import json
from tokenizers import Tokenizer
from egemma.engine.chunker import Chunker
from egemma.engine.tokenizer import resolved_tokenizer_json
from egemma.engine.process import cache_dir
from egemma.kernels import bpe
raw = resolved_tokenizer_json({str(checkpoints["eos"])!r})
d, added, glued = json.loads(raw), bpe.added_ids(Tokenizer.from_str(raw)), Chunker(raw).glued
for _ in range(300):
    bpe.Bpe(d, added, glued, 4, cache_dir())  # freed at once: no reference is kept
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_library_is_built_only_into_a_directory_of_this_users_own(tmp_path, monkeypatch):
    """A library loaded into the server comes from a cache directory nobody else can write: a group- or
    world-writable one (or a link) is passed over for the next."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "egemma").mkdir(mode=0o777)
    os.chmod(shared / "egemma", 0o777)
    assert bpe._lib_dir(shared / "egemma") != shared / "egemma"
    own = tmp_path / "own"
    assert bpe._lib_dir(own / "egemma") == own / "egemma" and bpe.library(own / "egemma")
    assert any(own.glob("egemma/bpe-*.so"))
