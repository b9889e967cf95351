"""Gemma's tokenizer in C (egemma/kernels/bpe.c) for tokenizer.json files whose pipeline it reproduces to the id: added
tokens matched on the raw text, the Replace(" " -> "▁") normaliser, no pre-tokenizer that splits anything, and a
byte-fallback BPE. Its reference is Hugging Face `tokenizers` on the same file (tests/test_bpe.py). The library
is compiled with the system C compiler on first use and cached by its source's hash, as Triton-lang does its
launcher; egemma.engine.tokenizer picks it, or tokenizers when `why_not` says why not, once at load."""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("bpe.c")
NCP = 0x110000
CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


class Unsupported(ValueError):
    pass


def _no_op_pre(pre: dict | None) -> bool:
    """A pre-tokenizer that splits nothing once " " is "▁": none, or splits on " " (kept)."""
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(map(_no_op_pre, pre.get("pretokenizers", [])))
    return pre.get("type") == "Split" and pre.get("pattern") == {"String": " "} and not pre.get("invert") \
        and pre.get("behavior") != "Removed"


def why_not(d: dict) -> str | None:
    """Why the C tokenizer would not give this tokenizer.json's ids, or None."""
    m = d.get("model") or {}
    vocab = m.get("vocab") or {}
    if d.get("normalizer") != {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}:
        return "the normaliser is not Gemma's ' ' -> '▁'"
    if not _no_op_pre(d.get("pre_tokenizer")):
        return "a pre-tokenizer that splits or rewrites"
    if m.get("type") != "BPE" or m.get("dropout") or m.get("ignore_merges") or m.get("continuing_subword_prefix") \
            or m.get("end_of_word_suffix"):
        return "not a plain BPE model"
    if not m.get("byte_fallback") or any(f"<0x{b:02X}>" not in vocab for b in range(256)):
        return "no byte fallback for every byte"
    if "▁" not in vocab:
        return "no token for '▁'"
    if any(a.get("normalized") or a.get("lstrip") or a.get("rstrip") or a.get("single_word")
           for a in d.get("added_tokens") or []):
        return "added tokens matched after normalising, or stripping / whole-word ones"
    if d.get("truncation") or d.get("padding"):
        return "truncation or padding in the file (tokenizers applies them; this code does not)"
    return None


def _own_dir(d: Path) -> bool:
    """d exists (made if not), is this user's, not a link, and writable by nobody else: a library loaded from it
    runs in the server."""
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
    except (OSError, RuntimeError):
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _lib_dir(cache: Path | None) -> Path:
    """cache (the deployment's cache directory, egemma.engine.process.cache_dir) if it is this user's own, else a
    directory of the user's own under the temporary directory."""
    for d in (cache, Path(tempfile.gettempdir()) / f"egemma-{os.getuid()}"):
        if d is not None and _own_dir(d):
            return d
    raise Unsupported("no cache directory of this user's own for the compiled library")


def library(cache: Path | None) -> ctypes.CDLL:
    """The compiled bpe.c, built now into cache (_lib_dir) if this source was never built there with this compiler
    for this machine. Unsupported when it cannot be: no compiler, no source (an install without it), a library
    that does not load."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise Unsupported("no C compiler (cc) to build egemma/kernels/bpe.c")
    try:
        src = SOURCE.read_bytes()
    except OSError as e:
        raise Unsupported(f"no source to build: {e}") from None
    tag = hashlib.sha256(src + "\0".join((platform.machine(), os.path.realpath(cc), *CFLAGS)).encode()).hexdigest()
    so = _lib_dir(cache) / f"bpe-{tag[:16]}.so"
    if not so.exists():
        fd, tmp = tempfile.mkstemp(dir=so.parent, prefix=so.name, suffix=".tmp")  # instances build at once
        os.close(fd)
        r = subprocess.run([cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if r.returncode:
            os.unlink(tmp)
            raise Unsupported(f"{cc} failed on egemma/kernels/bpe.c: {r.stderr.strip()[-500:]}")
        os.replace(tmp, so)
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as e:
        raise Unsupported(f"{so} does not load: {e}") from None
    p = ctypes.c_void_p
    lib.bpe_new.restype = p
    lib.bpe_new.argtypes = [p, p, p, ctypes.c_long, p, p, p, ctypes.c_long, p, ctypes.c_int, ctypes.c_int]
    lib.bpe_encode.restype = None
    lib.bpe_encode.argtypes = [p, ctypes.c_char_p, p, ctypes.c_long, ctypes.c_long, p, p]
    lib.bpe_free.restype = None
    lib.bpe_free.argtypes = [p]
    return lib


def added_ids(tok) -> dict[str, int]:
    """{content: id} of a tokenizers.Tokenizer's added tokens, as it loaded them (it renumbers some)."""
    return {t.content: i for i, t in tok.get_added_tokens_decoder().items()}


class Bpe:
    def __init__(self, d: dict, added: dict[str, int], glued: set[str], threads: int, cache: Path | None):
        """d: a parsed tokenizer.json (why_not(d) is None); added: its added tokens' ids as tokenizers loads them
        (added_ids); glued: the characters after which a " " is no safe cut
        (egemma.engine.chunker.Chunker.glued); threads: pool threads beside the calling one; cache: where the
        compiled library is kept (library)."""
        if why := why_not(d):
            raise Unsupported(why)
        m = d["model"]
        vocab = m["vocab"]
        cp = np.full(NCP, -1, np.int32)
        for t, i in vocab.items():
            if len(t) == 1:
                cp[ord(t)] = i
        byte = np.array([vocab[f"<0x{b:02X}>"] for b in range(256)], np.int32)
        try:
            pairs = [p if isinstance(p, list) else p.split(" ") for p in m["merges"]]
            merges = np.array([(vocab[a], vocab[b], vocab[a + b]) for a, b in pairs], np.int32).reshape(-1, 3)
        except (KeyError, ValueError) as e:
            raise Unsupported(f"a merge outside the vocabulary: {e}") from None
        contents = [a.encode() for a in added]
        aoff = np.zeros(len(contents) + 1, np.int32)
        np.cumsum([len(c) for c in contents], out=aoff[1:])
        aid = np.array(list(added.values()), np.int32)
        g = np.array(sorted(map(ord, glued)), np.uint32)
        self.threads = threads
        self.lib = library(cache)
        self.m = self.lib.bpe_new(cp.ctypes.data, byte.ctypes.data, merges.ctypes.data, len(merges),
                                  b"".join(contents), aoff.ctypes.data, aid.ctypes.data, len(added), g.ctypes.data,
                                  len(g), threads)
        if not self.m:
            raise MemoryError("egemma/kernels/bpe.c: out of memory")
        self.lock = threading.Lock()  # one call at a time per model (its threads' scratch is the model's)
        weakref.finalize(self, self.lib.bpe_free, self.m)  # its threads stopped, its memory freed

    def encode(self, texts: list[str], chunk_bytes: int = 2048) -> list[np.ndarray]:
        """int32 ids of each text (no specials), as views of one buffer. Texts are cut into pieces of about
        chunk_bytes for the pool where the ids cannot change (the chunker's safe cuts)."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        bs = [t.encode() for t in texts]
        off = np.zeros(len(bs) + 1, np.int64)
        np.cumsum([len(b) for b in bs], out=off[1:])
        if off[-1] >= 2 ** 31:
            raise ValueError(f"{int(off[-1])} bytes in one call: egemma/kernels/bpe.c indexes them with int32")
        out = np.empty(max(int(off[-1]), 1), np.int32)
        count = np.empty(len(bs), np.int64)
        with self.lock:
            self.lib.bpe_encode(self.m, b"".join(bs), off.ctypes.data, len(bs), chunk_bytes, out.ctypes.data,
                                count.ctypes.data)
        if len(bs) and count.min() < 0:
            raise MemoryError("egemma/kernels/bpe.c: out of memory")
        return [out[o:o + c] for o, c in zip(off.tolist(), count.tolist())]
