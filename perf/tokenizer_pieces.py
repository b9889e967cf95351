"""How the size of the tokenizer's parallel pieces (egemma.engine.chunker.Chunker) affects 8 texts of ~2048 tokens,
back to back and 20 ms apart (as in w1, where the tokenizer waits for the encoder between requests).

  python perf/tokenizer_pieces.py CHECKPOINT        # prints the median ms per piece size (40 interleaved runs)"""
import copy
import random
import statistics
import sys
import time
from pathlib import Path

from bench_serve import make_text, prose
from egemma.engine.config import ModelConfig
from egemma.engine.chunker import Chunker
from egemma.engine.tokenizer import TextTokenizer, resolved_tokenizer_json

SIZES = (256, 512, 768, 1024, 1536, 2048, 4096)

ck = Path(sys.argv[1])
tok, raw = TextTokenizer(ModelConfig.load(ck)), resolved_tokenizer_json(ck)
words, rng = prose(), random.Random(0)
batches = [[make_text(tok, words, 2047, rng) for _ in range(8)] for _ in range(2)]  # alternated
variants = {}
for size in SIZES:
    variants[size] = copy.copy(tok)
    variants[size].chunker = Chunker(raw, size)
for gap in (0.0, 0.02):
    ms = {size: [] for size in SIZES}
    for rep in range(40):
        for size, v in variants.items():
            time.sleep(gap)
            t0 = time.perf_counter()
            v.encode(batches[rep % 2])
            ms[size].append((time.perf_counter() - t0) * 1e3)
    print(f"{gap * 1e3:.0f} ms apart:", " ".join(f"{s}: {statistics.median(m):.2f}" for s, m in ms.items()), flush=True)
