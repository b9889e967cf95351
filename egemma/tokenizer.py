"""Text -> token ids exactly as sentence-transformers tokenises for the same checkpoint, with two
guarantees on top: every sequence is `BOS ... EOS` (missing specials are added, never doubled), and
truncation to max_seq_length keeps EOS last."""
from __future__ import annotations

import json
import logging
import re

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from egemma.config import ModelConfig

log = logging.getLogger("egemma")


def resolved_tokenizer_json(path) -> str:
    """The Rust tokenizer exactly as transformers builds it for this checkpoint (its tokenizer class may rebuild
    the pipeline and the BOS/EOS post-processor from tokenizer_config.json): what sentence-transformers uses."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)).backend_tokenizer.to_str()


def split_words(tokenizer_json: str) -> tuple[str, str | None]:
    """The same tokenizer, faster on long texts: (json, None), or (unchanged json, why not).

    Gemma's pre-tokenizer splits on " " after the normalizer has turned every " " into "▁", so each text reaches
    BPE as one word: a 2048-token text is merged as a whole and never hits BPE's word cache. This adds a split
    before every "▁" run that follows a character c such that no vocabulary token contains c + "▁". No merge
    can produce a token across such a boundary, so BPE gives the same ids on the pieces as on the whole (only
    Gemma's ">▁</" keeps ">" out of the split set)."""
    d = json.loads(tokenizer_json)
    m = d.get("model", {})
    if m.get("type") != "BPE" or m.get("dropout") or m.get("ignore_merges") or \
            m.get("continuing_subword_prefix") or m.get("end_of_word_suffix"):
        return tokenizer_json, "not a plain BPE model"
    vocab = m.get("vocab", {})
    if not any("▁" in t for t in vocab):
        return tokenizer_json, "no '▁' in the vocabulary"
    glued = "".join(sorted({c for t in vocab for c in re.findall("([^▁])▁", t)}))

    def esc(chars: str) -> str:  # Oniguruma code-point escapes: safe for any character in a class
        return "".join(f"\\x{{{ord(c):x}}}" for c in chars)
    sp = esc("▁")
    piece = f"[^{sp}{esc(glued)}]" + (f"|[{esc(glued)}]{sp}*" if glued else "")  # a glued char keeps its "▁"s
    split = {"type": "Split", "pattern": {"Regex": f"{sp}+(?:{piece})*|(?:{piece})+"},
             "behavior": "Isolated", "invert": False}
    pre = d.get("pre_tokenizer")
    d["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [pre, split] if pre else [split]}
    return json.dumps(d, ensure_ascii=False), None


class PromptError(ValueError):
    pass


class TextTokenizer:
    def __init__(self, cfg: ModelConfig, tokenizer_json: str | None = None):
        """tokenizer_json: a file written from `resolved_tokenizer_json` (the serve launcher writes one, so the
        server's Python needs no transformers); by default it is resolved here."""
        self.cfg = cfg
        raw = Path(tokenizer_json).read_text(encoding="utf-8") if tokenizer_json else resolved_tokenizer_json(cfg.path)
        fast, why_not = split_words(raw)
        log.info("egemma: tokenizer %s", f"as is ({why_not})" if why_not else "with word splits (same ids, faster)")
        self.tok = Tokenizer.from_str(fast)
        self.tok.no_padding()
        self.tok.no_truncation()
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a").ids
        self.adds_bos = full[:1] == [cfg.bos_id] and full[1:1 + len(plain)] == plain
        self.adds_eos = full[-1:] == [cfg.eos_id] and len(full) == len(plain) + self.adds_bos + 1
        if len(full) != len(plain) + self.adds_bos + self.adds_eos:
            raise ValueError(f"{cfg.path}: the tokenizer adds special tokens other than BOS/EOS: {full} vs {plain}")
        self.untruncated = Tokenizer.from_str(self.tok.to_str())  # for lengths: truncation is per Tokenizer
        budget = cfg.max_seq_length - (not self.adds_bos) - (not self.adds_eos)
        self.tok.enable_truncation(max_length=budget)
        self.max_length = cfg.max_seq_length

    def prefix(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The prompt text prepended to each input, as SentenceTransformer.encode(prompt_name=/prompt=)."""
        if prompt is not None and prompt_name is not None:
            raise PromptError("give either prompt or prompt_name, not both")
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.cfg.default_prompt_name
        if name is None:
            return ""
        if name not in self.cfg.prompts:
            raise PromptError(f"unknown prompt_name {name!r}; valid: {sorted(self.cfg.prompts)}")
        return self.cfg.prompts[name]

    def untruncated_length(self, text: str) -> int:
        """Tokens the text would take without truncation, specials included."""
        return len(self.untruncated.encode(text, add_special_tokens=False).ids) + 2

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """int32 id arrays, BOS ... EOS, at most max_seq_length long. One batched call for all texts."""
        encs = self.tok.encode_batch_fast(texts)
        head = [self.cfg.bos_id] if not self.adds_bos else []
        tail = [self.cfg.eos_id] if not self.adds_eos else []
        if not head and not tail:
            return [np.asarray(e.ids, dtype=np.int32) for e in encs]
        return [np.asarray(head + e.ids + tail, dtype=np.int32) for e in encs]
