"""Texts longer than one window, in one place (docs/long-documents.md): how a text's tokens are cut into windows of
the model's length, how the encoder finds them again in a row, and how the windows' vectors make the text's one
vector. Torch-free: the tokenizer model, the gateway (token-id inputs) and the encoder model all use it."""
from __future__ import annotations

import numpy as np


class WindowError(ValueError):
    """A request whose windows cannot be made (the prompt fills a window, an overlap as long as one)."""


def room(max_len: int, prompt: int, overlap: int) -> int:
    """Text tokens per window of max_len tokens: BOS + `prompt` prompt tokens + text + EOS."""
    r = max_len - 2 - prompt
    if r < 1:
        raise WindowError(f"the prompt takes {prompt} tokens, leaving no room for text in a {max_len}-token window "
                          "(BOS + prompt + text + EOS): shorten the prompt")
    if not 0 <= overlap < r:
        raise WindowError(f"chunk_overlap {overlap} must lie in [0, {r}): each window holds {r} text tokens "
                          f"beside BOS, the {prompt}-token prompt and EOS")
    return r


def spans(n: int, room: int, overlap: int = 0) -> list[tuple[int, int]]:
    """[start, end) of each window's text tokens among a text's n tokens: consecutive windows of `room` tokens (the
    last shorter), each starting `overlap` tokens before the previous one ends; one window, maybe empty, when the
    text fits."""
    out, a = [(0, min(n, room))], 0
    while out[-1][1] < n:
        a += room - overlap
        out.append((a, min(a + room, n)))
    return out


def cut(seq: np.ndarray, prompt: int, max_len: int, overlap: int = 0) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(the windows of seq = BOS + prompt ids + text ids + EOS, concatenated; each window's text-token span). Every
    window is BOS + the prompt ids + its text tokens + EOS, so every window but the last is exactly max_len long,
    which is how the encoder finds them again (split)."""
    r = room(max_len, prompt, overlap)
    head, text, eos = seq[:1 + prompt], seq[1 + prompt:-1], seq[-1:]
    sp = spans(len(text), r, overlap)
    if len(sp) == 1:
        return seq, sp
    return np.concatenate([p for a, b in sp for p in (head, text[a:b], eos)]), sp


def split(row: np.ndarray, max_len: int) -> list[np.ndarray]:
    """A row of windows (cut) back into its windows: max_len tokens each, the last one shorter."""
    return [row[a:a + max_len] for a in range(0, len(row), max_len)]


def combine(x: np.ndarray, lengths, counts) -> np.ndarray:
    """Each text's vector [n, D] from its windows' vectors x [B, D] (before L2 normalisation), text t being the next
    counts[t] rows: mean pooling over all tokens of all its windows, i.e. the windows' means weighted by their
    lengths. x is the Dense projector's output, an affine map of the mean, which keeps weighted means whose weights
    sum to 1: so the combination may follow it. fp64, per text in window order (the same bits in any batch); a
    one-window text keeps its vector's bits."""
    w = np.asarray(lengths, np.float64)
    ends = np.cumsum(counts)
    starts = ends - np.asarray(counts)
    total = np.add.reduceat(w, starts)
    return (np.add.reduceat(x.astype(np.float64) * w[:, None], starts, axis=0) / total[:, None]).astype(np.float32)


def normalized(x: np.ndarray) -> np.ndarray:
    """Rows L2-normalised (the checkpoint's Normalize module), fp32."""
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32, copy=False)
