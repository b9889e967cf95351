"""The product's vocabulary, in one torch-free module that every tier (the client too) imports: the served model's
names, the models' input and output tensors, the output encodings, the request options with their one rule, their
one parser and their one tensor encoding (OPTIONS), and the environment variables the product reads.

Options are sent as KServe request `parameters` to the ensemble (which forwards them to both models); defaults
reproduce plain SentenceTransformer.encode. The tokenizer model also passes the options that shape the encoder's
output (dimensions, encoding, chunks) on as its OPTIONS tensor, so that Triton's response cache, which keys on input
tensors and never on parameters, keys on them too."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

HUB_ID = "google/embeddinggemma-300m"  # the checkpoint on the Hugging Face hub, and the name the gateway serves
ENSEMBLE, TOKENIZER, ENCODER = "embeddinggemma", "embeddinggemma_tokenizer", "embeddinggemma_encoder"

# tensors: the ensemble takes TEXT; the tokenizer gives INPUT_IDS, SEQ_LEN, OPTIONS (and CHUNK_SPAN) to the encoder
TEXT, INPUT_IDS, SEQ_LEN, OPTIONS = "TEXT", "INPUT_IDS", "SEQ_LEN", "OPTIONS"
NUM_TOKENS = "NUM_TOKENS"  # tokens embedded per text: prompt, BOS and EOS included (every window with chunks)
EMBEDDING = "EMBEDDING"
CHUNK_EMBEDDING, CHUNK_OF, CHUNK_SPAN = "CHUNK_EMBEDDING", "CHUNK_OF", "CHUNK_SPAN"  # return_chunks: per window
OUTPUTS = {"float": EMBEDDING, "ubinary": "EMBEDDING_UBINARY", "binary": "EMBEDDING_BINARY"}  # encoding -> output
ENCODINGS = tuple(OUTPUTS)  # OPTIONS carries an encoding as its index here
MATRYOSHKA = (768, 512, 256, 128)  # the sizes EmbeddingGemma was trained to truncate to
LONG_TEXT = ("truncate", "error", "chunk")  # what a text over the model's length gets: cut, refused, windowed
# The longest text the tokenizer model takes, in UTF-8 bytes with its prompt, where its config.pbtxt leaves
# max_text_bytes empty; the client checks it before sending. 1 MB is ~250k tokens, far past the 2048 embedded.
MAX_TEXT_BYTES = 1_000_000
# Texts one request to the ensemble (and the tokenizer model) may carry: their config.pbtxt's max_batch_size, which
# Triton needs written there (tests/test_placement.py holds the two equal). The gateway splits larger requests.
MAX_BATCH = 64


# The paths a model reads where its config.pbtxt leaves the parameter empty, and the environment variable each comes
# from: the launcher passes paths this way, never in config.pbtxt, whose text Triton serves to anyone
# (/v2/models/X/config, gRPC's ModelConfig). Read in one place: egemma.stub.adapter.env_path.
PATH_ENV = {"checkpoint": "EMBEDDINGGEMMA_PATH", "tokenizer_json": "EGEMMA_TOKENIZER_JSON"}


class OptionError(ValueError):
    pass


INT32 = 1 << 31
# Each option's JSON type. No coercion: "48", 48.7 and true are not the integer 48, and "false" is not false.
TYPES = {"prompt_name": (str, "a string without NUL"), "prompt": (str, "a string without NUL"),
         "dimensions": (int, f"an integer in [1, {INT32 - 1}]"), "truncate": (bool, "true or false"),
         "encoding": (str, f"one of {', '.join(OUTPUTS)}"), "long_text": (str, f"one of {', '.join(LONG_TEXT)}"),
         "chunk_overlap": (int, f"an integer in [0, {INT32 - 1}]"), "return_chunks": (bool, "true or false")}
CHOICES = {"encoding": OUTPUTS, "long_text": LONG_TEXT}
LOWEST = {"dimensions": 1, "chunk_overlap": 0}


def check(name: str, value):
    """The one rule for an option's value, on every protocol (the gateway's OpenAI and TEI fields too): of its type,
    no NUL in a string (Triton's C API ends a string parameter there: "query\\0x" would be taken as "query"), an
    integer within int32 (the OPTIONS tensor's type; dimensions are then checked against the model's list, an overlap
    against the window), an enum's value from its list. The value, or OptionError naming the option."""
    t, what = TYPES[name]
    if type(value) is not t or (t is str and "\0" in value) or (t is int and not LOWEST[name] <= value < INT32) or (
            name in CHOICES and value not in CHOICES[name]):
        raise OptionError(f"{name} must be {what}, got {json.dumps(value, default=repr)[:100]}")
    return value


@dataclass(frozen=True)
class RequestOptions:
    prompt_name: str | None = None  # a name from config_sentence_transformers.json
    prompt: str | None = None  # a literal prefix
    dimensions: int | None = None  # Matryoshka truncation, then renormalisation
    encoding: str = "float"  # float | ubinary | binary (sentence-transformers quantize_embeddings)
    # a text over max_seq_length: truncate (cut), error, or chunk (windows, one vector: egemma.engine.windows)
    long_text: str = "truncate"
    chunk_overlap: int = 0  # chunk: tokens each window repeats of the one before
    return_chunks: bool = False  # chunk: each window's vector and spans too (CHUNK_* outputs)

    @property
    def truncate(self) -> bool:
        """The parameter truncate, kept as an alias: false is long_text=error."""
        return self.long_text != "error"

    @property
    def chunks(self) -> int:
        """What the encoder makes of a row (OPTIONS' third column): 0 one sequence, 1 windows combined into one
        vector, 2 that and each window's vector."""
        return 0 if self.long_text != "chunk" else 1 + self.return_chunks

    @classmethod
    def parse(cls, parameters_json: str | None) -> "RequestOptions":
        if not parameters_json or parameters_json == "{}":  # most requests: skip the JSON round trip
            return DEFAULTS
        return cls.of(json.loads(parameters_json))

    @classmethod
    def of(cls, p: dict) -> "RequestOptions":
        """The options of request parameters already decoded (the gateway's); OptionError for a bad one."""
        if not p:
            return DEFAULTS
        p = dict(p)
        known = sorted({*cls.__dataclass_fields__, "truncate"})
        unknown = sorted(set(p) - set(known))
        if unknown:
            raise OptionError(f"unknown parameters {unknown}; known: {known}")
        for k, v in p.items():
            check(k, v)
        if "truncate" in p:
            alias = "truncate" if p.pop("truncate") else "error"
            if p.setdefault("long_text", alias) != alias:
                raise OptionError(f"truncate={str(alias == 'truncate').lower()} contradicts long_text="
                                  f"{p['long_text']}: give long_text alone")
        chunking = p.get("long_text") == "chunk"
        if not chunking and (p.get("chunk_overlap") or p.get("return_chunks")):
            raise OptionError("chunk_overlap and return_chunks apply to long_text=chunk")
        if p.get("return_chunks") and p.get("encoding", "float") != "float":
            raise OptionError("return_chunks gives float vectors: leave encoding float")
        return cls(**p)


DEFAULTS = RequestOptions()


def to_tensor(opts: RequestOptions, rows: int) -> np.ndarray:
    """OPTIONS for a request of `rows` rows: INT32 [rows, 3], each (dimensions, 0 for the full size; encoding;
    chunks: RequestOptions.chunks)."""
    return np.tile(np.array([opts.dimensions or 0, ENCODINGS.index(opts.encoding), opts.chunks], np.int32), (rows, 1))


def from_tensor(opts: RequestOptions, t: np.ndarray) -> RequestOptions:
    """The options of an OPTIONS tensor (its third column, chunks, 0 where absent) over those of the parameters,
    which must agree where they give them."""
    if t.ndim != 2 or t.shape[1] not in (2, 3) or (t.shape[0] and (t != t[:1]).any()):
        raise OptionError(f"OPTIONS must be [rows, 2 or 3] and the same in every row, got {t.tolist()}")
    dims, enc, chunks = (*(int(v) for v in t[0]), 0, 0)[:3] if t.shape[0] else (0, 0, 0)
    if not 0 <= enc < len(ENCODINGS) or dims < 0 or not 0 <= chunks <= 2 or (chunks == 2 and enc):
        raise OptionError(f"OPTIONS {[dims, enc, chunks]}: dimensions must be >= 0, encoding one of 0-"
                          f"{len(ENCODINGS) - 1} ({', '.join(ENCODINGS)}), chunks 0-2 (2 with encoding 0)")
    got = RequestOptions(opts.prompt_name, opts.prompt, dims or None, ENCODINGS[enc],
                         "chunk" if chunks else opts.long_text if opts.long_text != "chunk" else "truncate",
                         opts.chunk_overlap if chunks else 0, chunks == 2)
    if (opts.dimensions not in (None, got.dimensions)) or (opts.encoding not in ("float", got.encoding)) or \
            (opts.chunks and opts.chunks != got.chunks):
        raise OptionError(f"the parameters (dimensions {opts.dimensions}, encoding {opts.encoding}, long_text "
                          f"{opts.long_text}, return_chunks {opts.return_chunks}) disagree with OPTIONS "
                          f"({got.dimensions}, {got.encoding}, chunks {got.chunks})")
    return got
