"""Token ids equal sentence-transformers' for both tokenizer variants (+EOS where the checkpoint omits it)."""
import pytest

from helpers import UNICODE, expected_ids, make_texts, st_model
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import PromptError, TextTokenizer

EDGE = ["", " ", "x", "<eos>", "<bos>", "<pad><unk>", "a <eos> b", "text<eos>", " leading", "trailing ",
        "the a of " * 1500, "kalo " * 5000] + UNICODE


@pytest.mark.parametrize("variant", ["eos", "noeos"])
def test_ids_match_sentence_transformers(checkpoints, variant):
    tok = TextTokenizer(ModelConfig.load(checkpoints[variant]))
    assert tok.adds_eos == (variant == "eos")
    m = st_model(checkpoints[variant])
    texts = EDGE + make_texts(30, 300)
    ours = [s.tolist() for s in tok.encode(texts)]
    assert ours == expected_ids(m, texts)
    for s in ours:
        assert s[0] == 2 and s[-1] == 1 and len(s) <= 2048
    assert max(len(s) for s in ours) == 2048  # the long texts were truncated, EOS kept last


@pytest.mark.parametrize("prompt_name", ["query", "document", "STS", "Retrieval-query"])
def test_prompts_match_sentence_transformers(checkpoints, prompt_name):
    tok = TextTokenizer(ModelConfig.load(checkpoints["eos"]))
    texts = make_texts(8, 40) + ["the a of " * 1500]
    prefix = tok.prefix(prompt_name=prompt_name)
    assert [s.tolist() for s in tok.encode([prefix + t for t in texts])] == \
        expected_ids(st_model(checkpoints["eos"]), texts, prompt_name=prompt_name)


def test_unknown_prompt_lists_valid_names(checkpoints):
    tok = TextTokenizer(ModelConfig.load(checkpoints["eos"]))
    with pytest.raises(PromptError, match="Retrieval-query"):
        tok.prefix(prompt_name="nope")
    assert tok.prefix(prompt="literal: ") == "literal: "
    assert tok.prefix() == ""


@pytest.mark.parametrize("variant", ["eos", "noeos"])
def test_resolved_tokenizer_file_gives_the_same_ids(checkpoints, variant, tmp_path):
    """The serve launcher hands the tokenizer model a pre-resolved tokenizer.json: same ids as resolving it."""
    from egemma.engine.tokenizer import resolved_tokenizer_json
    cfg = ModelConfig.load(checkpoints[variant])
    f = tmp_path / "tokenizer.json"
    f.write_text(resolved_tokenizer_json(checkpoints[variant]))
    texts = EDGE + make_texts(10, 300)
    a, b = TextTokenizer(cfg, str(f)), TextTokenizer(cfg)
    assert (a.adds_bos, a.adds_eos) == (b.adds_bos, b.adds_eos)
    assert [s.tolist() for s in a.encode(texts)] == [s.tolist() for s in b.encode(texts)]



def glued_bpe() -> str:
    """A Gemma-like BPE (spaces normalised to "▁", which the " " split then never sees) trained without word
    boundaries, so merges glue characters across "▁": the case Chunker must respect."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    corpus = ["<b> </b> a> </p>", "the cat sat", "x y x y x y", "ab  cd\t ef\nab"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    tok.add_tokens([AddedToken("\n x", normalized=False)])  # glues "\n" to the space after it
    return tok.to_str()


ODD = "ab >< /\n\t▁é日🚀xy"


@pytest.mark.parametrize("source", ["glued", "checkpoint"])
def test_pieces_give_the_same_ids(checkpoints, source):
    """Ids of a text's pieces, concatenated, are the whole text's ids; truncated texts cut early keep their
    first n ids. Pieces of 8 characters, so nearly every safe cut is taken."""
    import random
    from tokenizers import Tokenizer
    from egemma.engine.chunker import Chunker
    from egemma.engine.tokenizer import resolved_tokenizer_json
    raw = glued_bpe() if source == "glued" else resolved_tokenizer_json(checkpoints["eos"])
    chunker, tok = Chunker(raw, chunk_chars=8), Tokenizer.from_str(raw)
    assert chunker.why_not is None
    if source == "glued":
        assert {">", "\n"} <= chunker.glued and "é" not in chunker.glued  # merges, the added token / never
    rng = random.Random(0)
    texts = EDGE + make_texts(30, 300) + ["<b> </b>  a> </p>", "x y  x y", "> </", ">  ", "  >", " " * 40]
    texts += ["".join(rng.choice(ODD) for _ in range(rng.randint(0, 200))) for _ in range(2000)]
    for t in texts:
        want = tok.encode(t, add_special_tokens=False).ids
        got = [i for p in chunker.pieces(t) for i in tok.encode(p, add_special_tokens=False).ids]
        assert got == want, t
        assert "".join(chunker.pieces(t)) == t
        for n in (2, 5):
            short = [i for p in chunker.pieces(t, n) for i in tok.encode(p, add_special_tokens=False).ids]
            assert short[:n] == want[:n], t


def test_chunker_refuses_what_it_cannot_prove():
    """A pre-tokenizer that adds characters (ByteLevel's prefix space) or unknowns that fuse over any length
    turn cutting, or its truncation bound, off."""
    import json
    from egemma.engine.chunker import Chunker
    d = json.loads(glued_bpe())
    assert Chunker(json.dumps(d)).longest is not None
    d["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    assert "pre-tokenizer" in Chunker(json.dumps(d)).why_not
    d = json.loads(glued_bpe())
    d["model"]["fuse_unk"], d["model"]["byte_fallback"] = True, False
    assert Chunker(json.dumps(d)).longest is None
