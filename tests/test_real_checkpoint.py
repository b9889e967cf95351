"""google/embeddinggemma-300m itself (real weights, real Gemma tokenizer) through the real server, against
sentence-transformers. Runs when EMBEDDINGGEMMA_PATH points at the checkpoint."""
import numpy as np
import tritonclient.grpc as grpcclient

from helpers import assert_close, st_model
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer

TEXTS = ["", "Which planet is known as the Red Planet?",
         "Mars, known for its reddish appearance, is often referred to as the Red Planet. " * 6,
         "Grüße aus Köln! 日本語のテキスト 🚀 <eos> literal specials <bos>",
         "Venus is often called Earth's twin because of its similar size and proximity. " * 30]


def test_real_tokenizer_matches(real_checkpoint):
    tok = TextTokenizer(ModelConfig.load(real_checkpoint))
    m = st_model(real_checkpoint)
    texts = TEXTS + ["word " * 3000, "x> </y z " * 16000]  # the second: cut before tokenising (Chunker)
    f = m.tokenize(texts)
    want = [r[:int(k.sum())].tolist() for r, k in zip(f["input_ids"], f["attention_mask"])]
    assert [s.tolist() for s in tok.encode(texts)] == want


def test_real_checkpoint_served_equals_sentence_transformers(real_server, real_checkpoint):
    c = grpcclient.InferenceServerClient(real_server.grpc_url)
    i = grpcclient.InferInput("TEXT", [len(TEXTS), 1], "BYTES")
    i.set_data_from_numpy(np.array([[t.encode()] for t in TEXTS], dtype=object))
    got = c.infer("embeddinggemma", [i]).as_numpy("EMBEDDING")
    ref = st_model(real_checkpoint).encode(TEXTS, convert_to_numpy=True)
    assert got.shape == (len(TEXTS), 768)
    assert_close(got, ref)


def test_pieces_keep_real_gemma_ids(real_checkpoint):
    """Texts tokenised in pieces (egemma.engine.chunker.Chunker) against Gemma's tokenizer on whole texts: prose,
    code, HTML and random strings of the characters that matter (">" is glued to "▁" by a merge)."""
    import glob
    import random
    from pathlib import Path

    from tokenizers import Tokenizer

    from egemma.engine.chunker import Chunker
    from egemma.engine.tokenizer import resolved_tokenizer_json
    raw = resolved_tokenizer_json(real_checkpoint)
    chunker, tok = Chunker(raw, chunk_chars=64), Tokenizer.from_str(raw)
    assert chunker.why_not is None and chunker.glued == {" ", "▁", ">"}, chunker.glued
    root = Path(__file__).resolve().parent.parent
    texts = [Path(f).read_text(errors="ignore") for f in sorted(glob.glob(f"{root}/**/*.py", recursive=True))]
    texts += TEXTS + ["<b> </b>  <i>   </i>", "a> </p>\n\t> \u2581</", "x" * 5000 + " y" * 3000]
    rng = random.Random(0)
    texts += ["".join(rng.choice("ab >< /\n\t\u2581é日🚀") for _ in range(rng.randint(0, 200)))
              for _ in range(3000)]
    whole = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    pieces = [[i for p in chunker.pieces(t) for i in tok.encode(p, add_special_tokens=False).ids] for t in texts]
    assert pieces == whole
