"""The per-request token budget: how many tokens one request may have the models embed (all its rows; a long text
cut into windows, all its windows). The tokenizer's and the encoder's config parameter `max_request_tokens`, which
the launcher's --max-request-tokens sets. One check, `check`, called where a request's tokens are known: the
tokenizer model once it has tokenised a request, the encoder on its input ids. A request over it is refused alone,
before any of it is embedded (INVALID_ARG naming the limit: HTTP 400, TEI 422); the others in its batch are served."""
from __future__ import annotations

from egemma.spec import MAX_BATCH, OptionError

# Twice the gateway's largest call (MAX_BATCH texts of 2048 tokens). One request of 256 x 2048 ids to the encoder,
# over it, kept two CPU cores busy for ~6 minutes; on a GPU it is ~1 s, so a GPU server may raise the limit.
DEFAULT = 2 * MAX_BATCH * 2048
PARAMETER = "max_request_tokens"


def limit(value: str) -> int:
    """The budget a model's config parameter PARAMETER sets (empty: DEFAULT)."""
    n = int(value or DEFAULT)
    if n < 1:
        raise ValueError(f"{PARAMETER} must be at least 1, got {n}")
    return n


def check(tokens: int, limit: int):
    """OptionError for a request of `tokens` tokens over `limit`."""
    if tokens > limit:
        raise OptionError(f"this request has {tokens} tokens, over this server's limit of {limit} tokens per request "
                          "(--max-request-tokens); send fewer or shorter inputs per request")
