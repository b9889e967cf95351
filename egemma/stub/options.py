"""Per-request options, sent as KServe request `parameters` to the ensemble (which forwards them to both
models). Defaults reproduce plain SentenceTransformer.encode. The tokenizer model also passes the options that shape
the encoder's output (dimensions, encoding) on as its OPTIONS tensor, so that Triton's response cache, which keys on
input tensors and never on parameters, keys on them too."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

OUTPUTS = {"float": "EMBEDDING", "ubinary": "EMBEDDING_UBINARY", "binary": "EMBEDDING_BINARY"}
MATRYOSHKA = (768, 512, 256, 128)  # the sizes EmbeddingGemma was trained to truncate to


class OptionError(ValueError):
    pass


INT32 = 1 << 31
# Each option's JSON type. No coercion: "48", 48.7 and true are not the integer 48, and "false" is not false.
TYPES = {"prompt_name": (str, "a string without NUL"), "prompt": (str, "a string without NUL"),
         "dimensions": (int, f"an integer in [1, {INT32 - 1}]"), "truncate": (bool, "true or false"),
         "encoding": (str, f"one of {', '.join(OUTPUTS)}")}


def check(name: str, value):
    """The one rule for an option's value, on every protocol (the gateway's OpenAI and TEI fields too): of its type,
    no NUL in a string (Triton's C API ends a string parameter there: "query\\0x" would be taken as "query"), an
    integer within int32 (the OPTIONS tensor's type; dimensions are then checked against the model's list), an
    encoding of OUTPUTS. The value, or OptionError naming the option."""
    t, what = TYPES[name]
    if type(value) is not t or (t is str and "\0" in value) or (t is int and not 0 < value < INT32) or (
            name == "encoding" and value not in OUTPUTS):
        raise OptionError(f"{name} must be {what}, got {json.dumps(value, default=repr)[:100]}")
    return value


@dataclass(frozen=True)
class RequestOptions:
    prompt_name: str | None = None  # a name from config_sentence_transformers.json
    prompt: str | None = None  # a literal prefix
    dimensions: int | None = None  # Matryoshka truncation, then renormalisation
    truncate: bool = True  # False: a text over max_seq_length is an error instead of being cut
    encoding: str = "float"  # float | ubinary | binary (sentence-transformers quantize_embeddings)

    @classmethod
    def parse(cls, parameters_json: str | None) -> "RequestOptions":
        if not parameters_json or parameters_json == "{}":  # most requests: skip the JSON round trip
            return DEFAULTS
        p = json.loads(parameters_json)
        unknown = sorted(set(p) - set(cls.__dataclass_fields__))
        if unknown:
            raise OptionError(f"unknown parameters {unknown}; known: {sorted(cls.__dataclass_fields__)}")
        for k, v in p.items():
            check(k, v)
        return cls(**p)


DEFAULTS = RequestOptions()
ENCODINGS = tuple(OUTPUTS)  # OPTIONS carries an encoding as its index here


def to_tensor(opts: RequestOptions, rows: int) -> np.ndarray:
    """OPTIONS for a request of `rows` rows: INT32 [rows, 2], each (dimensions, 0 for the full size; encoding)."""
    return np.tile(np.array([opts.dimensions or 0, ENCODINGS.index(opts.encoding)], np.int32), (rows, 1))


def from_tensor(opts: RequestOptions, t: np.ndarray) -> RequestOptions:
    """The options of an OPTIONS tensor over those of the parameters, which must agree where they give them."""
    if t.ndim != 2 or t.shape[1] != 2 or (t.shape[0] and (t != t[:1]).any()):
        raise OptionError(f"OPTIONS must be [rows, 2] and the same in every row, got {t.tolist()}")
    dims, enc = (int(v) for v in t[0]) if t.shape[0] else (0, 0)
    if not 0 <= enc < len(ENCODINGS) or dims < 0:
        raise OptionError(f"OPTIONS {[dims, enc]}: dimensions must be >= 0 and encoding one of 0-{len(ENCODINGS) - 1} "
                          f"({', '.join(ENCODINGS)})")
    got = RequestOptions(opts.prompt_name, opts.prompt, dims or None, opts.truncate, ENCODINGS[enc])
    if (opts.dimensions not in (None, got.dimensions)) or (opts.encoding not in ("float", got.encoding)):
        raise OptionError(f"the parameters (dimensions {opts.dimensions}, encoding {opts.encoding}) disagree with "
                          f"OPTIONS ({got.dimensions}, {got.encoding})")
    return got


def allowed_dimensions(spec: str, out_dim: int) -> tuple[int, ...]:
    """From a config parameter like "768,512,256,128"; empty: out_dim and the Matryoshka sizes below it."""
    dims = tuple(int(d) for d in spec.split(",") if d.strip()) if spec.strip() else \
        (out_dim, *(d for d in MATRYOSHKA if d < out_dim))
    if any(not 0 < d <= out_dim for d in dims):
        raise ValueError(f"matryoshka_dims {dims} must lie in [1, {out_dim}]")
    return dims


def check_dimensions(opts: RequestOptions, allowed: tuple[int, ...]):
    if opts.dimensions is not None and opts.dimensions not in allowed:
        raise OptionError(f"dimensions {opts.dimensions} is not supported; choose from {list(allowed)}")


def shape_output(emb: np.ndarray, opts: RequestOptions) -> tuple[str, np.ndarray]:
    """(output name, tensor) for one request's fp32 embeddings [n, D] (options already checked):
    truncate + renormalise, then quantize."""
    if opts.dimensions is not None and opts.dimensions != emb.shape[1]:
        emb = emb[:, :opts.dimensions]
        emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    if opts.encoding == "float":
        return OUTPUTS["float"], np.ascontiguousarray(emb, dtype=np.float32)
    bits = np.packbits(emb > 0, axis=-1)
    return OUTPUTS[opts.encoding], bits if opts.encoding == "ubinary" else (bits - 128).astype(np.int8)
