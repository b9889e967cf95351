"""Text -> token ids exactly as sentence-transformers tokenises for the same checkpoint, with two
guarantees on top: every sequence is `BOS ... EOS` (missing specials are added, never doubled), and
truncation to max_seq_length keeps EOS last."""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from egemma.config import ModelConfig


def resolved_tokenizer_json(path) -> str:
    """The Rust tokenizer exactly as transformers builds it for this checkpoint (its tokenizer class may rebuild
    the pipeline and the BOS/EOS post-processor from tokenizer_config.json): what sentence-transformers uses."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)).backend_tokenizer.to_str()


class PromptError(ValueError):
    pass


class TextTokenizer:
    def __init__(self, cfg: ModelConfig, tokenizer_json: str | None = None):
        """tokenizer_json: a file written from `resolved_tokenizer_json` (the serve launcher writes one, so the
        server's Python needs no transformers); by default it is resolved here."""
        self.cfg = cfg
        self.tok = Tokenizer.from_file(tokenizer_json) if tokenizer_json else \
            Tokenizer.from_str(resolved_tokenizer_json(cfg.path))
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
