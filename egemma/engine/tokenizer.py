"""Text -> token ids exactly as sentence-transformers tokenises for the same checkpoint, with two
guarantees on top: every sequence is `BOS ... EOS` (added here, also where the checkpoint's tokenizer omits
EOS), and truncation to max_seq_length keeps EOS last."""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
from importlib import metadata
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from egemma.engine.chunker import Chunker
from egemma.engine.config import ModelConfig
from egemma.engine.process import cache_dir, configured, unwritable, usable_cores
from egemma.kernels import bpe

TOKENIZER_BACKENDS = ("auto", "c", "tokenizers")
DEFAULT_BACKEND = "auto"  # the tokenizer model's tokenizer_backend when its config.pbtxt leaves it empty
C_PIECE_BYTES = 1024  # egemma/kernels/bpe.c's pieces: 512-1024 bytes were fastest on the GPU host

log = logging.getLogger("egemma")


def resolved_tokenizer_json(path) -> str:
    """The Rust tokenizer exactly as transformers builds it for this checkpoint (its tokenizer class may rebuild
    the pipeline and the BOS/EOS post-processor from tokenizer_config.json): what sentence-transformers uses."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path)).backend_tokenizer.to_str()


def _entry(path) -> Path:
    """The cache entry of this checkpoint's resolved tokenizer: keyed by its tokenizer files (names, sizes, mtimes)
    and the transformers version."""
    files = sorted(f for f in Path(path).iterdir() if f.is_file() and (
        f.name.startswith(("tokenizer", "special_")) or f.name in ("added_tokens.json", "config.json")))
    key = hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
                              + [metadata.version("transformers")]).encode()).hexdigest()[:24]
    return configured() / "tokenizer" / f"{key}.json"


def _read(entry: Path) -> str | None:
    try:
        text = entry.read_text(encoding="utf-8")
        json.loads(text)
        return text
    except (OSError, ValueError):  # a miss, or a corrupt entry: resolved again
        return None


def _lock(entry: Path):
    """The cache's lock, held (released when the returned file closes): one process at a time resolves a miss."""
    lock = open(entry.parent / ".lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def _fill(path, entry: Path, lock) -> str:
    """Under the held lock (released here): the entry, resolved and written unless another process has just done so."""
    with lock:
        if (text := _read(entry)) is None:
            text = resolved_tokenizer_json(path)
            write_atomic(entry, text)
    return text


def cached_tokenizer_json(path, resolve: bool = True) -> str | None:
    """resolved_tokenizer_json, from $EGEMMA_CACHE_DIR/tokenizer when it holds it (importing transformers alone
    takes seconds of every start); without $EGEMMA_CACHE_DIR, or with a cache that cannot be written, resolved each
    time. A miss is resolved by one process at a time (the others wait, then read it); resolve=False: None on a
    miss."""
    if configured() is None:
        return resolved_tokenizer_json(path) if resolve else None
    entry = _entry(path)
    if (text := _read(entry)) is not None or not resolve:
        return text
    if unwritable(entry.parent):
        return resolved_tokenizer_json(path)
    return _fill(path, entry, _lock(entry))


def resolve_ahead(path) -> threading.Thread | None:
    """On a cache miss, resolve into the cache on a thread of this process, holding the cache's lock from before
    this returns: processes started next (the tokenizer model's instances) wait on it and read the entry, so they
    never import transformers themselves, which a stub's environment may not manage (numpy 1.26 against a host's
    numpy-2 builds of scipy). None where there is nothing to do."""
    if configured() is None or _read(entry := _entry(path)) is not None or unwritable(entry.parent):
        return None
    t = threading.Thread(target=_fill, args=(path, entry, _lock(entry)), name="egemma-tokenizer-resolve", daemon=True)
    t.start()
    return t


def write_atomic(path: Path, text: str):
    """Readers see no file, or the old one, or the whole new one; a failed write leaves nothing behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


class PromptError(ValueError):
    pass


class TextTokenizer:
    def __init__(self, cfg: ModelConfig, tokenizer_json: str | None = None, backend: str = DEFAULT_BACKEND,
                 threads: int | None = None):
        """tokenizer_json: a file written from `resolved_tokenizer_json` (the server's launcher writes one from its
        cache); where it is missing, it is taken from the cache (cached_tokenizer_json; on a cold cache the launcher
        resolves it there while the models load: resolve_ahead) and written there, for the gateway. backend: "c"
        (egemma/kernels/bpe.c: the same ids, several times faster), "tokenizers" (Hugging Face's), or "auto": c where it
        reproduces this tokenizer and builds here, else tokenizers; the choice is logged. Asking for c where it cannot
        be is an error. threads: the C tokenizer's pool beside the calling thread (default: one per other usable
        core)."""
        if backend not in TOKENIZER_BACKENDS:
            raise ValueError(f"tokenizer backend {backend!r}: choose from {TOKENIZER_BACKENDS}")
        self.cfg = cfg
        f = Path(tokenizer_json) if tokenizer_json else None
        # the boot log says which: the launcher's file, or the cache (resolved here where there is none)
        self.source = "file" if f is not None and f.exists() else "cache" if configured() is not None else "resolved"
        if self.source == "file":
            raw = f.read_text(encoding="utf-8")
        else:
            raw = cached_tokenizer_json(cfg.path)
            if f is not None:
                write_atomic(f, raw)
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
        d = json.loads(raw)
        self.chunker = Chunker(d)
        self.bpe, why = None, "asked for" if backend == "tokenizers" else self.chunker.why_not
        if not why:  # bpe.c cuts words where the chunker may: only with its cuts
            try:  # no truncation or padding, as above
                self.bpe = bpe.Bpe({**d, "truncation": None, "padding": None}, bpe.added_ids(self.tok),
                                   self.chunker.glued, usable_cores() - 1 if threads is None else threads, cache_dir())
            except bpe.Unsupported as e:
                why = str(e)
        if backend == "c" and why:
            raise ValueError(f"{cfg.path}: tokenizer backend 'c' cannot serve this tokenizer: {why}")
        self.backend = "c" if self.bpe else "tokenizers"
        self.piece_bytes = C_PIECE_BYTES  # the C tokenizer's pieces (tokenizers': the chunker's chunk_chars)
        log.info("egemma: tokenizer backend %s%s, %s", self.backend, f" ({why})" if why else
                 f" (egemma/kernels/bpe.c, {self.bpe.threads + 1} threads)",
                 f"one piece per text ({self.chunker.why_not})" if self.chunker.why_not
                 else f"texts in pieces of ~{self.piece_bytes} bytes, tokenised in parallel" if self.bpe
                 else f"texts in pieces of ~{self.chunker.chunk_chars} characters, tokenised in parallel")
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

    def _ids(self, texts: list[str], max_tokens: int | None) -> list[list[np.ndarray]]:
        """Each text's ids without specials, as int32 arrays of its pieces, all texts in one parallel call. The C
        tokenizer cuts and spreads the pieces itself; with tokenizers they are cut here, and small work stays on
        this thread (its parallel call's hand-offs cost more than a few short texts)."""
        c = self.chunker
        if self.bpe is not None:
            return [[ids] for ids in self.bpe.encode([c.head(t, max_tokens) for t in texts], self.piece_bytes)]
        if all(len(t) <= c.chunk_chars for t in texts):  # the common case: every text is one piece
            split = [[t] for t in texts]
        else:
            split = [c.pieces(t, max_tokens) for t in texts]
        pieces = [p for ps in split for p in ps]
        encs = [self.tok.encode(p, add_special_tokens=False) for p in pieces] \
            if sum(map(len, pieces)) <= c.chunk_chars else self.tok.encode_batch_fast(pieces, add_special_tokens=False)
        ids = [np.asarray(e.ids, dtype=np.int32) for e in encs]
        out, k = [], 0
        for ps in split:
            out.append(ids[k:k + len(ps)])
            k += len(ps)
        return out

    def untruncated_length(self, text: str) -> int:
        """Tokens the text would take without truncation, specials included."""
        return sum(map(len, self._ids([text], None)[0])) + 2

    def encode(self, texts: list[str], whole: bool = False) -> list[np.ndarray]:
        """int32 id arrays BOS ... EOS, at most max_seq_length long (EOS kept last); whole: untruncated."""
        n, out = self.max_length - 2, []
        for pieces in self._ids(texts, None if whole else n):
            r = np.empty((sum(map(len, pieces)) if whole else min(sum(map(len, pieces)), n)) + 2, np.int32)
            r[0], r[-1], k = self.cfg.bos_id, self.cfg.eos_id, 1
            for p in pieces:
                take = min(len(p), len(r) - 1 - k)
                r[k:k + take] = p[:take]
                k += take
            out.append(r)
        return out

    def encode_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(int32 ids BOS ... EOS, untruncated; int64 [len - 2, 2] character span [start, end) of each token between
        BOS and EOS) per text, from Hugging Face's tokenizer (the same ids as encode's, with the offsets it keeps)."""
        out = []
        for e in self.tok.encode_batch(texts, add_special_tokens=False):
            ids = np.empty(len(e.ids) + 2, np.int32)
            ids[0], ids[1:-1], ids[-1] = self.cfg.bos_id, e.ids, self.cfg.eos_id
            out.append((ids, np.asarray(e.offsets, np.int64).reshape(-1, 2)))
        return out
