"""Token ids equal sentence-transformers' for both tokenizer variants (+EOS where the checkpoint omits it)."""
import pytest

from conftest import UNICODE, expected_ids, make_texts, st_model
from egemma.config import ModelConfig
from egemma.tokenizer import PromptError, TextTokenizer

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
    from egemma.tokenizer import resolved_tokenizer_json
    cfg = ModelConfig.load(checkpoints[variant])
    f = tmp_path / "tokenizer.json"
    f.write_text(resolved_tokenizer_json(checkpoints[variant]))
    texts = EDGE + make_texts(10, 300)
    a, b = TextTokenizer(cfg, str(f)), TextTokenizer(cfg)
    assert (a.adds_bos, a.adds_eos) == (b.adds_bos, b.adds_eos)
    assert [s.tolist() for s in a.encode(texts)] == [s.tolist() for s in b.encode(texts)]



def glued_bpe() -> str:
    """A Gemma-like BPE (spaces normalised to "▁", which the " " split then never sees) trained without word
    boundaries, so merges glue characters across "▁": the case split_words must respect."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    corpus = ["<b> </b> a> </p>", "the cat sat", "x y x y x y", "ab  cd\t ef\nab"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    return tok.to_str()


ODD = "ab >< /\n\t▁é日🚀xy"


@pytest.mark.parametrize("source", ["glued", "checkpoint"])
def test_word_splits_give_the_same_ids(checkpoints, source):
    import random
    from tokenizers import Tokenizer
    from egemma.tokenizer import resolved_tokenizer_json, split_words
    raw = glued_bpe() if source == "glued" else resolved_tokenizer_json(checkpoints["eos"])
    fast, why_not = split_words(raw)
    assert why_not is None
    if source == "glued":
        assert "\\x{3e}" in fast  # ">" glued to "▁" by a merge: no split after it
    rng = random.Random(0)
    texts = EDGE + make_texts(30, 300) + ["<b> </b>  a> </p>", "x y  x y", "> </", ">  ", "  >"]
    texts += ["".join(rng.choice(ODD) for _ in range(rng.randint(0, 80))) for _ in range(2000)]
    plain, split = Tokenizer.from_str(raw), Tokenizer.from_str(fast)
    assert [e.ids for e in split.encode_batch(texts)] == [e.ids for e in plain.encode_batch(texts)]
