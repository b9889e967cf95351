"""The benchmarks' texts (perf/lib/corpora.py) hold the token counts they promise, with the checkpoint's tokenizer:
the peers comparison (perf/peers/peers.py) relies on no text going over a server's 2048-token limit, where servers
differ (ours and sentence-transformers truncate, vLLM rejects)."""
import random

import pytest

from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from perf.lib import corpora


@pytest.fixture(scope="module")
def tok(checkpoints) -> TextTokenizer:
    return TextTokenizer(ModelConfig.load(checkpoints["eos"]))


@pytest.mark.parametrize("n", [4, 16, 180, 2048])
def test_text_reaches_or_stays_within_its_length(tok, n):
    words, rng = corpora.prose(), random.Random(n)
    for _ in range(5):
        reach = corpora.make_text(tok, words, n, rng)
        within = corpora.make_text(tok, words, n, rng, within=True)
        assert tok.untruncated_length(reach) >= n
        assert within and tok.untruncated_length(within) <= n


def test_corpus_and_mixed_texts_stay_within_the_cap(tok):
    rng = random.Random(0)
    docs = corpora.lognormal_docs(tok, corpora.prose(), 200, rng, median=180, cap=512)
    lengths = sorted(tok.untruncated_length(d) for d in docs)
    assert len(docs) == 200 and lengths[-1] <= 512 and 90 <= lengths[100] <= 360  # median near 180
    texts = corpora.mixed(tok, corpora.prose(), rng)
    assert len(texts) == 40 and all(1 <= tok.untruncated_length(t) <= 2048 for t in texts)
