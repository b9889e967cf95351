"""Cutting texts where Gemma's tokenizer cannot merge across, so long texts tokenise as parallel pieces."""
from __future__ import annotations

import json
import re


def _splits_only(pre: dict | None) -> bool:
    """Whether a pre-tokenizer only splits on literal spaces or "▁" (adds and drops no character)."""
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(map(_splits_only, pre.get("pretokenizers", [])))
    return pre.get("type") == "Split" and pre.get("pattern") in ({"String": " "}, {"String": "▁"}) \
        and pre.get("behavior") != "Removed" and not pre.get("invert")


class Chunker:
    """Cuts texts where the tokenizer's ids cannot change, so long texts tokenise as several pieces in parallel.

    Gemma's normaliser turns every " " into "▁" before its pre-tokenizer splits on " " (which is then never
    there), so each text reaches BPE as one word and a 2048-token text costs one core ~2.4 ms. A cut before a
    " " that follows a character c is safe when no vocabulary token contains c + "▁" and no added token contains
    c + " " or c + "▁": no merge or added-token match can span it, so the ids of the pieces, concatenated, are
    the ids of the whole (only ">", from Gemma's ">▁</", is excluded). For the same reason the first n tokens
    come from the first n * longest-token characters, so truncated texts are cut there first."""

    def __init__(self, tokenizer_json: str | dict, chunk_chars: int = 2048):
        """tokenizer_json: a tokenizer.json's text, or the file parsed."""
        d = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
        m = d.get("model", {})
        self.why_not = None
        if d.get("normalizer") != {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}:
            self.why_not = "the normaliser is not Gemma's ' ' -> '▁'"
        elif m.get("type") != "BPE" or m.get("dropout") or m.get("ignore_merges") or \
                m.get("continuing_subword_prefix") or m.get("end_of_word_suffix"):
            self.why_not = "not a plain BPE model"
        elif not _splits_only(d.get("pre_tokenizer")):  # e.g. ByteLevel / Metaspace add characters per piece
            self.why_not = "a pre-tokenizer other than splits on ' ' / '▁'"
        added = d.get("added_tokens") or []
        if any(a.get("lstrip") or a.get("rstrip") or a.get("single_word") for a in added):
            self.why_not = "added tokens that strip or match whole words"
        vocab = m.get("vocab", {})
        # a character without a token of its own arrives as <0xXX> tokens, which the text-based rule below cannot
        # see: with merges on them, a cut after such a character may split a merge (Gemma has none)
        byte_tokens = {f"<0x{b:02X}>" for b in range(256)}
        if any(t in byte_tokens for mg in m.get("merges", []) for t in (mg if isinstance(mg, list) else mg.split(" "))):
            self.why_not = "merges of byte-fallback tokens"
        self.glued = {" ", "▁"} | {c for t in vocab for c in re.findall("([^▁])▁", t)} | \
            {c for a in added for c in re.findall("(.)[ ▁]", a["content"], re.S)}
        # every character is >= 1 token unless unknowns are fused (byte fallback covers all bytes: none unknown)
        no_unk = not m.get("fuse_unk") or (m.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)))
        self.longest = max(map(len, [*vocab, *(a["content"] for a in added)]), default=1) if no_unk else None
        self.chunk_chars = chunk_chars

    def cut(self, text: str, pos: int) -> int:
        """The first safe cut at or after pos (len(text) if none)."""
        while (i := text.find(" ", pos)) >= 0:
            if i > 0 and text[i - 1] not in self.glued:
                return i
            pos = i + 1
        return len(text)

    def head(self, text: str, max_tokens: int | None) -> str:
        """As much of text as can make max_tokens tokens (all of it without max_tokens)."""
        if self.why_not or max_tokens is None or not self.longest or len(text) <= max_tokens * self.longest:
            return text
        return text[:self.cut(text, max_tokens * self.longest)]

    def pieces(self, text: str, max_tokens: int | None = None) -> list[str]:
        """text in pieces of about chunk_chars; with max_tokens, only as much text as can make that many tokens."""
        if self.why_not:
            return [text]
        text = self.head(text, max_tokens)
        out, start = [], 0
        while len(text) - start > self.chunk_chars:
            end = self.cut(text, start + self.chunk_chars)
            out.append(text[start:end])
            start = end
        return out + [text[start:]] if start < len(text) else out
