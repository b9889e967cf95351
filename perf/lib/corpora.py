"""The benchmarks' texts, built from real text on the machine that runs them and sized in tokens with the
checkpoint's tokenizer (specials included): English prose (the installed packages' descriptions), source code
(numpy's own .py files), CJK prose (CPython's cjkencodings test texts), a lognormal document corpus and a mixed
set for fidelity checks. Used by perf/serving/bench_serve.py, perf/peers/peers.py and the other serving benchmarks."""
import glob
import math
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from egemma.engine.tokenizer import TextTokenizer


def prose() -> list[str]:
    """Words of real English text: the package descriptions installed on this machine."""
    words = []
    for f in sorted(glob.glob(f"{Path(np.__file__).parent.parent}/*.dist-info/METADATA"))[:400]:
        body = Path(f).read_text(errors="ignore").split("\n\n", 1)[-1]
        words += re.sub(r"[`*#<>\[\]()|=_]+", " ", body).split()
    return words


def code() -> str:
    """Real source code with its docstrings and indentation: numpy's own Python files."""
    return "\n".join(Path(f).read_text(errors="ignore") for f in sorted(glob.glob(f"{Path(np.__file__).parent}/**/*.py",
                                                                                     recursive=True))[:300])


def cjk(cjk_dir: Path | None, rng: random.Random) -> str:
    """Chinese, Japanese and Korean prose (CPython's cjkencodings test texts), sentences shuffled and repeated to
    ~200k characters; empty if none is found."""
    dirs = [cjk_dir] if cjk_dir else [Path(d) for d in glob.glob(f"{sys.base_prefix}/lib/python3*/test/cjkencodings")]
    sents = [x for d in dirs for f in sorted(d.glob("*-utf8.txt")) for x in re.split(r"(?<=[。．！？\n])", f.read_text())
             if x.strip()]
    out, n = [], 0
    while sents and n < 200_000:
        rng.shuffle(sents)
        out += sents
        n += sum(map(len, sents))
    return "".join(out)


def _fewest(length: Callable[[int], int], n_tokens: int, hi: int) -> int:
    """The smallest k in [1, hi] with length(k) >= n_tokens (length grows with k), by bisection."""
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if length(mid) >= n_tokens:
            hi = mid
        else:
            lo = mid + 1
    return lo


def make_chars(tok: TextTokenizer, corpus: str, n_tokens: int, rng: random.Random) -> str:
    """The shortest slice of corpus from a random start that reaches n_tokens (specials included)."""
    start = rng.randrange(0, len(corpus) - 8 * n_tokens)
    k = _fewest(lambda m: tok.untruncated_length(corpus[start:start + m]), n_tokens, 8 * n_tokens)
    return corpus[start:start + k]


def make_text(tok: TextTokenizer, words: list[str], n_tokens: int, rng: random.Random, within: bool = False) -> str:
    """The fewest words from a random start that reach n_tokens (specials included); within: the most words that
    stay within n_tokens instead (a text no server truncates or rejects at a limit of n_tokens; another start where
    the first word alone is over)."""
    while True:
        start = rng.randrange(0, len(words) - 4 * n_tokens)
        k = _fewest(lambda m: tok.untruncated_length(" ".join(words[start:start + m])), n_tokens + within,
                    4 * n_tokens)
        if k > within:
            return " ".join(words[start:start + k - within])


def lognormal_docs(tok: TextTokenizer, words: list[str], n: int, rng: random.Random, median: int = 180,
                   sigma: float = 1.0, cap: int = 2048) -> list[str]:
    """n documents of prose whose token counts are lognormal (median `median`, sigma `sigma`: mean ~1.65 x the
    median) and capped at `cap`, each within its drawn length."""
    lengths = [min(cap, max(4, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]
    return [make_text(tok, words, m, rng, within=True) for m in lengths]


def mixed(tok: TextTokenizer, words: list[str], rng: random.Random, cjk_text: str = "") -> list[str]:
    """40 texts of every kind a server meets, all within 2048 tokens: 10 queries of 4-24 tokens, 10 passages of
    100-400, 6 long prose of 1000-2048, 6 source code and 6 CJK slices of 32-1024 (prose where no CJK text is
    found), a one-word text and one with emoji and accents."""
    src = code()
    out = [make_text(tok, words, rng.randint(4, 24), rng, within=True) for _ in range(10)]
    out += [make_text(tok, words, rng.randint(100, 400), rng, within=True) for _ in range(10)]
    out += [make_text(tok, words, rng.randint(1000, 2048), rng, within=True) for _ in range(6)]
    out += [make_chars(tok, src, rng.randint(32, 1024), rng) for _ in range(6)]
    out += [make_chars(tok, cjk_text, rng.randint(32, 1024), rng) if len(cjk_text) > 16 * 1024
            else make_text(tok, words, rng.randint(32, 1024), rng, within=True) for _ in range(6)]
    return out + ["hello", "Café ☕ naïve façade — déjà vu 🚀🌍 ñandú"]
