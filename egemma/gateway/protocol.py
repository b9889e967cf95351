"""The bodies of the OpenAI and TEI embedding APIs, apart from their serving and their routes (as vLLM's protocol
module): each API's schema read from the raw body into one Embed (JSON, the API's own fields, the request options by
egemma.spec's one rule and parser), its fields checked in the order written here, so that a body with several bad
fields is told of the first. Every refusal is a GatewayError naming the field."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

from egemma.gateway.errors import GatewayError, Kind
from egemma.spec import OptionError, RequestOptions, check, to_tensor

MAX_INPUTS = 2048  # inputs per HTTP request (OpenAI's own limit); the gateway splits them into calls of max_batch
PROMPTS = ("prompt_name", "prompt")  # options that only a text's tokenization can apply


@dataclass(frozen=True)
class Embed:
    """One embedding request, read."""
    items: list  # texts and token-id lists (any mix: TEI's), in the request's order
    params: dict  # the request options as Triton's request parameters, each checked
    opts: RequestOptions  # the same, parsed as the models parse them
    options: np.ndarray  # the same as one row of OPTIONS (egemma.spec.to_tensor), which token-id rows go with
    field: str  # the inputs' field, which their errors name
    id_errors: str = ""  # what a token-id input's error starts with
    base64: bool = False  # OpenAI's encoding_format=base64
    left: bool = False  # TEI's truncation_direction=left


def read(raw: bytes) -> dict:
    """The body as a JSON object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise GatewayError(Kind.MALFORMED, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise GatewayError(Kind.MALFORMED, "the body must be a JSON object")
    return body


def choice(body: dict, key: str, allowed: tuple[str, ...], default: str) -> str:
    """An API's own enum field: absent or null is the default, else one of allowed as a string (never "" or [] for
    the default)."""
    if (v := body.get(key)) is None:
        return default
    if not isinstance(v, str) or v not in allowed:
        raise GatewayError(Kind.VALIDATION, f"{key} must be one of {', '.join(map(repr, allowed))}, got "
                                            f"{orjson.dumps(v, default=repr).decode()[:100]}", key)
    return v


def flag(body: dict, key: str, default: bool) -> bool:
    if (v := body.get(key)) is None:
        return default
    if type(v) is not bool:
        raise GatewayError(Kind.VALIDATION, f"{key} must be true or false, got {v!r}", key)
    return v


def options(body: dict, keys, derive=None) -> dict:
    """The request options among keys that body gives (null: not given), each by the one rule (egemma.spec.check),
    then derive(params) (an API's own fields mapped onto options: TEI's truncate): Triton's request parameters."""
    params = {}
    for k in keys:
        if (v := body.get(k)) is None:
            continue
        try:
            params[k] = check(k, v)
        except OptionError as e:
            raise GatewayError(Kind.VALIDATION, str(e), k) from None
    return derive(params) if derive is not None else params


def no_prompt_with_ids(items: list, params: dict):
    """A prompt is applied by a text's tokenization: with token ids, the prompt's ids go first in the ids."""
    if any(not isinstance(t, str) for t in items) and (p := next((k for k in PROMPTS if k in params), None)):
        raise GatewayError(Kind.VALIDATION, f"{p} applies to text inputs; with token ids, put the prompt's ids "
                                            "first", p)


def parsed(params: dict) -> tuple[RequestOptions, np.ndarray]:
    """The options as the models parse them (egemma.spec's one parser; its combination rules come after every field
    check), and their OPTIONS row."""
    try:
        opts = RequestOptions.of(params)  # DEFAULTS for none
    except OptionError as e:
        raise GatewayError(Kind.VALIDATION, str(e)) from None
    return opts, to_tensor(opts, 1)


# OpenAI: POST /v1/embeddings, GET /v1/models[/{id}]
OPENAI_FIELDS = {"input", "model", "dimensions", "encoding_format", "user", "prompt_name", "prompt", "truncate",
                 "long_text", "chunk_overlap"}
OPENAI_OPTIONS = ("dimensions", "prompt_name", "prompt", "truncate", "long_text", "chunk_overlap")


def openai_embed(raw: bytes, gw) -> Embed:
    """POST /v1/embeddings's body (unknown fields are a 400, as OpenAI answers them)."""
    body = read(raw)
    unknown = sorted(set(body) - OPENAI_FIELDS)
    if unknown:
        raise GatewayError(Kind.VALIDATION, f"Unrecognized request argument supplied: {', '.join(unknown)}",
                           unknown[0])
    check_model(gw, body.get("model"))
    b64 = choice(body, "encoding_format", ("float", "base64"), "float") == "base64"
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise GatewayError(Kind.VALIDATION, f"user must be a string, got {body['user']!r}", "user")
    params = options(body, OPENAI_OPTIONS)
    items = openai_input(body.get("input"))
    no_prompt_with_ids(items, params)
    opts, row = parsed(params)
    return Embed(items, params, opts, row, "input", base64=b64)


def check_model(gw, name) -> None:
    """A model name the server answers to: the served one or an alias (absent: the served one); else 404."""
    if name is not None and not isinstance(name, str):
        raise GatewayError(Kind.VALIDATION, f"model must be a string, got {name!r}", "model")
    if name is not None and name != gw.model_name and name not in gw.aliases:
        raise GatewayError(Kind.NOT_FOUND, f"The model `{name}` does not exist; this server serves `{gw.model_name}`"
                                           + (f" (aliases: {', '.join(gw.aliases)})" if gw.aliases else ""), "model",
                           "model_not_found")


def openai_input(x) -> list:
    """OpenAI's input: a string, or at most 2048 strings, or one list of at most 2048 token ids (one input), or at
    most 2048 lists of token ids (each of any length: over 2048 tokens cut, as text is); as a list of inputs."""
    what = ("input must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
            "and not empty")
    if isinstance(x, str):
        x = [x]
    if not isinstance(x, list) or not x:
        raise GatewayError(Kind.VALIDATION, what, "input")
    if all(isinstance(t, str) for t in x):
        rows = x
    elif all(type(t) is int for t in x):
        if len(x) > MAX_INPUTS:
            raise GatewayError(Kind.VALIDATION, f"input is one list of {len(x)} token ids, over the limit of "
                                                f"{MAX_INPUTS} for a flat list of ids (OpenAI's schema); send a "
                                                "longer input as a list of one token-id list, cut to 2048 tokens "
                                                "unless truncate is false", "input")
        rows = [x]
    elif all(isinstance(r, list) and r and all(type(t) is int for t in r) for r in x):
        rows = x
    else:
        raise GatewayError(Kind.VALIDATION, "input must be all strings or all token id lists (non-empty lists of "
                                            "integers)", "input")
    if len(rows) > MAX_INPUTS:
        raise GatewayError(Kind.VALIDATION, f"input has {len(rows)} inputs, over the limit of {MAX_INPUTS} "
                                            "inputs per request", "input")
    if "" in rows:
        raise GatewayError(Kind.EMPTY, f"input[{rows.index('')}] is an empty string, which cannot be embedded",
                           "input")
    return rows


# TEI: POST /embed, POST /tokenize
TEI_OPTIONS = ("prompt_name", "dimensions", "long_text", "chunk_overlap")


def tei_embed(raw: bytes) -> Embed:
    """POST /embed's body. TEI's truncate and truncation_direction map to long_text: left truncation is honoured
    exactly when nothing is cut, so it asks for no truncation at all (the serving call says why on a refusal)."""
    body = read(raw)
    items = tei_inputs(body.get("inputs"), ids_ok=True)
    if not flag(body, "normalize", True):
        raise GatewayError(Kind.VALIDATION, "normalize=false is not supported: this model's embeddings are always "
                                            "L2-normalised (its Normalize module runs inside the encoder)")
    truncate = flag(body, "truncate", True)
    left = choice(body, "truncation_direction", ("Left", "Right", "left", "right"), "Right").lower() == "left"

    def long_text(params: dict) -> dict:
        if "long_text" in params and body.get("truncate") is not None:
            raise GatewayError(Kind.VALIDATION, "give long_text or truncate, not both (truncate=false is "
                                                "long_text=error)", "long_text")
        want = params.get("long_text", "truncate" if truncate else "error")
        want = "error" if want == "truncate" and left else want
        return params if want == params.get("long_text", "truncate") else {**params, "long_text": want}
    params = options(body, TEI_OPTIONS, long_text)
    no_prompt_with_ids(items, params)
    opts, row = parsed(params)
    return Embed(items, params, opts, row, "inputs", id_errors="token ids: ", left=left and truncate)


def tei_tokenize(raw: bytes) -> tuple[list[str], bool, dict]:
    """POST /tokenize's body: (texts, add_special_tokens, the request options for the tokenizer model)."""
    body = read(raw)
    texts = tei_inputs(body.get("inputs"), ids_ok=False)
    specials = flag(body, "add_special_tokens", True)
    truncate = flag(body, "truncate", True)
    return texts, specials, {"truncate": truncate, **options(body, ("prompt_name",))}


def tei_inputs(x, ids_ok: bool) -> list:
    """TEI's Input: a string, one id list, or a list of strings / id lists; returns the list. Nothing in it may be
    empty (TEI's tokenizer refuses an empty input: `Empty`)."""
    if isinstance(x, str) or (ids_ok and isinstance(x, list) and x and all(type(t) is int for t in x)):
        x = [x]
    if not isinstance(x, list):
        raise GatewayError(Kind.VALIDATION, "inputs must be a string or a list of "
                           + ("strings or token id lists" if ids_ok else "strings"), "inputs")
    if not x:
        raise GatewayError(Kind.EMPTY, "`inputs` cannot be empty", "inputs")
    if len(x) > MAX_INPUTS:
        raise GatewayError(Kind.VALIDATION, f"batch size {len(x)} > maximum allowed batch size {MAX_INPUTS}",
                           "inputs")
    for j, t in enumerate(x):
        if not (isinstance(t, str) or ids_ok and isinstance(t, list) and all(type(i) is int for i in t)):
            raise GatewayError(Kind.VALIDATION, f"inputs[{j}] must be a string"
                               + (" or a list of token ids" if ids_ok else ""), "inputs")
        if not t:
            raise GatewayError(Kind.EMPTY, f"`inputs` cannot be empty: inputs[{j}] is", "inputs")
    return x
