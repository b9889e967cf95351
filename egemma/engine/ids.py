"""The id rule, in one place: which token ids can be embedded, and how a client's ids become what the encoder embeds
(exactly what their text would give). Torch-free: the gateway completes clients' ids with it, the engine and the
encoder model check every batch with it."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from egemma.engine.windows import cut


def problem(ids: np.ndarray, vocab_size: int, positions: int, longest: int | None = None) -> str | None:
    """Why these ids cannot be embedded, or None: one sequence, or several rows' ids flattened (longest: the longest
    row's length): empty, longer than the model's positions, or an id outside the vocabulary."""
    n = ids.size if longest is None else longest
    if ids.ndim != 1 or ids.size == 0:
        return "ids must be 1-D and non-empty"
    if n > positions:
        return f"sequence of {n} tokens exceeds the model's {positions} positions"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        return f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})"
    return None


def complete(ids: Sequence[int], cfg, long_text: str = "truncate", overlap: int = 0) -> np.ndarray:
    """A client's ids as the encoder embeds them (cfg: egemma.engine.config.ModelConfig): BOS prepended unless the
    first id is BOS, EOS appended unless the last is EOS (so ids with or without specials embed as their text does),
    over max_seq_length cut keeping EOS last (long_text truncate), or refused (error), or windowed (chunk, as a
    text without a prompt: egemma.engine.windows.cut), as text is. ValueError for an id outside the vocabulary, or
    an over-long sequence with long_text=error."""
    try:
        a = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id past int64 (JSON numbers go to 2^64): outside the vocabulary all the same
        raise ValueError(f"a token id outside the vocabulary [0, {cfg.vocab_size})") from None
    if a.size and (why := problem(a, cfg.vocab_size, a.size)):
        raise ValueError(why)
    head = [cfg.bos_id] if not a.size or a[0] != cfg.bos_id else []
    tail = [cfg.eos_id] if not a.size or a[-1] != cfg.eos_id else []
    seq = np.concatenate([head, a, tail]).astype(np.int32)
    if long_text == "chunk":
        return cut(seq, 0, cfg.max_seq_length, overlap)[0]
    if seq.size > cfg.max_seq_length:
        if long_text == "error":
            raise ValueError(f"{seq.size} tokens with BOS/EOS, over the {cfg.max_seq_length}-token limit "
                             "(long_text=error, or truncate=false)")
        seq = np.append(seq[:cfg.max_seq_length - 1], np.int32(cfg.eos_id))
    return seq
