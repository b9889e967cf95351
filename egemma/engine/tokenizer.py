"""Text -> token ids exactly as sentence-transformers tokenises for the same checkpoint, with two
guarantees on top: every sequence is `BOS ... EOS` (added here, also where the checkpoint's tokenizer omits
EOS), and truncation to max_seq_length keeps EOS last."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from egemma.engine.chunker import Chunker
from egemma.engine.config import ModelConfig

log = logging.getLogger("egemma")


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
        raw = Path(tokenizer_json).read_text(encoding="utf-8") if tokenizer_json else resolved_tokenizer_json(cfg.path)
        self.tok = Tokenizer.from_str(raw)
        self.tok.no_padding()
        self.tok.no_truncation()
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a").ids
        # specials are added here, not by the tokenizer (its post-processor may omit EOS): know what it adds
        self.adds_bos = full[:1] == [cfg.bos_id] and full[1:1 + len(plain)] == plain
        self.adds_eos = full[-1:] == [cfg.eos_id] and len(full) == len(plain) + self.adds_bos + 1
        if len(full) != len(plain) + self.adds_bos + self.adds_eos:
            raise ValueError(f"{cfg.path}: the tokenizer adds special tokens other than BOS/EOS: {full} vs {plain}")
        self.chunker = Chunker(raw)
        log.info("egemma: tokenizer %s", f"in one piece per text ({self.chunker.why_not})" if self.chunker.why_not
                 else f"in pieces of ~{self.chunker.chunk_chars} characters, tokenised in parallel")
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
            shown = f"{name[:64]!r}{'...' if len(name) > 64 else ''}"  # a name of any size is never echoed whole
            raise PromptError(f"unknown prompt_name {shown}; valid: {sorted(self.cfg.prompts)}")
        return self.cfg.prompts[name]

    def _ids(self, texts: list[str], max_tokens: int | None) -> list[list[int]]:
        """Ids without specials, all texts' pieces tokenised in one call; small work stays on this thread (the
        parallel call's thread hand-offs cost more than a few short texts)."""
        c = self.chunker
        if all(len(t) <= c.chunk_chars for t in texts):  # the common case: every text is one piece
            pieces, owner = texts, None
        else:
            split = [c.pieces(t, max_tokens) for t in texts]
            pieces = [p for ps in split for p in ps]
            owner = [k for k, ps in enumerate(split) for _ in ps]
        if sum(map(len, pieces)) <= c.chunk_chars:
            encs = [self.tok.encode(p, add_special_tokens=False) for p in pieces]
        else:
            encs = self.tok.encode_batch_fast(pieces, add_special_tokens=False)
        if owner is None:
            return [e.ids for e in encs]
        out = [[] for _ in texts]
        for k, e in zip(owner, encs):
            out[k] += e.ids
        return out

    def untruncated_length(self, text: str) -> int:
        """Tokens the text would take without truncation, specials included."""
        return len(self._ids([text], None)[0]) + 2

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """int32 id arrays BOS ... EOS, at most max_seq_length long (EOS kept last)."""
        n = self.max_length - 2
        return [np.asarray([self.cfg.bos_id, *ids[:n], self.cfg.eos_id], dtype=np.int32)
                for ids in self._ids(texts, n)]
