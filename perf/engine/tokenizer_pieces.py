"""How the size of the tokenizer's parallel pieces (egemma.engine.chunker.Chunker) affects 8 texts of ~2048 tokens,
back to back and 20 ms apart (as in w1, where the tokenizer waits for the encoder between requests), for each
tokenizer backend. 16 different batches in turn, so that egemma/kernels/bpe.c's word cache sees new text as in serving.
"c solo" is the C tokenizer without its pool, at the default piece size: what idling costs one thread.

  python -m perf.engine.tokenizer_pieces CHECKPOINT        # prints the median ms per variant"""
import copy
import random
import statistics
import sys
import time
from pathlib import Path

from perf.lib.corpora import make_text, prose
from egemma.engine.config import ModelConfig
from egemma.engine.chunker import Chunker
from egemma.engine.tokenizer import C_PIECE_BYTES, TextTokenizer, resolved_tokenizer_json

SIZES = (256, 512, 768, 1024, 2048, 4096)


def main():
    ck = Path(sys.argv[1])
    cfg, raw = ModelConfig.load(ck), resolved_tokenizer_json(ck)
    toks = {b: TextTokenizer(cfg, backend=b) for b in ("c", "tokenizers")}
    toks["c solo"] = TextTokenizer(cfg, backend="c", threads=0)
    words, rng = prose(), random.Random(0)
    batches = [[make_text(toks["c"], words, 2047, rng) for _ in range(8)] for _ in range(16)]
    variants = {}
    for b, tok in toks.items():  # the C tokenizer cuts its own pieces (piece_bytes); tokenizers' are the chunker's
        for size in SIZES if b == "c" else (2048,) if b == "tokenizers" else (C_PIECE_BYTES,):
            variants[b, size] = v = copy.copy(tok)
            if tok.bpe is None:
                v.chunker = Chunker(raw, size)
            else:
                v.piece_bytes = size
    for gap in (0.0, 0.02):
        ms = {k: [] for k in variants}
        for rep in range(48):
            for k, v in variants.items():
                time.sleep(gap)
                t0 = time.perf_counter()
                v.encode(batches[rep % len(batches)])
                ms[k].append((time.perf_counter() - t0) * 1e3)
        print(f"{gap * 1e3:.0f} ms apart:",
              " ".join(f"{b} {s}: {statistics.median(m[16:]):.2f}" for (b, s), m in ms.items()), flush=True)


if __name__ == "__main__":
    main()
