"""What both Python-backend adapters (model_repository/*/1/model.py) share: their config.pbtxt parameters read
once, and one response per request with errors as pb_utils.TritonError carrying a code, so a bad request
costs only itself and never the dynamic batch it came in."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable

from egemma.engine import process
from egemma.engine.config import CheckpointError
from egemma.engine.tokenizer import PromptError
from egemma.engine.windows import WindowError
from egemma.spec import PATH_ENV, OptionError

log = logging.getLogger("egemma")
CLIENT_ERRORS = (OptionError, PromptError, WindowError)  # the request is at fault: INVALID_ARG with the message


def setup_logging():
    """egemma's INFO lines (each backend choice made at load) into the server's log, from the stub's stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def boot_phases(engine):
    """The boot phases inside Engine() after its weights (egemma.engine.process): the kernels' JIT and timed choices,
    then the CUDA graphs' capture, the last step of Engine() (its GraphRunner's capture_s)."""
    capture = engine.graphs.capture_s if engine.graphs is not None else 0.0
    end = time.time()
    process.phase("kernels", end=end - capture)
    process.phase("capture", end=end)


def env_path(name: str) -> str:
    """A path parameter's environment variable (egemma.spec.PATH_ENV), "" where unset: the one reader of them, for
    the models, the gateway (egemma.gateway.serving.facts) and the launcher's --model default."""
    return os.environ.get(PATH_ENV[name], "")


def triton_params(model_config: str | dict) -> tuple[str, dict[str, str]]:
    """(checkpoint, other non-empty string parameters) of a Triton model config (its JSON, as a model's
    initialize gets it, or parsed, as the gRPC API returns it). A path parameter the config declares empty is
    taken from its PATH_ENV variable."""
    cfg = json.loads(model_config) if isinstance(model_config, str) else model_config
    params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}
    for k in PATH_ENV:
        if (k == "checkpoint" or k in params) and not params.get(k):
            params[k] = env_path(k)
    ckpt = params.pop("checkpoint")
    if not ckpt:
        raise CheckpointError(f"model {cfg.get('name')}: no checkpoint: set the 'checkpoint' parameter in its "
                              "config.pbtxt or EMBEDDINGGEMMA_PATH (scripts/serve.sh does this for you)")
    return ckpt, {k: v for k, v in params.items() if v != ""}


class Adapter:
    """Response helpers bound to the stub's triton_python_backend_utils module (passed in, so that this module
    imports without Triton)."""

    def __init__(self, pb_utils):
        self.pb = pb_utils

    def invalid(self, message: str):
        return self.pb.InferenceResponse(error=self.pb.TritonError(message, self.pb.TritonError.INVALID_ARG))

    def internal(self, exc: BaseException, what: str = "internal error"):
        """A fault of ours: logged with its traceback, reported to that request only."""
        log.error("%s: %s", what, exc, exc_info=exc)
        return self.pb.InferenceResponse(error=self.pb.TritonError(f"{what}: {exc}", self.pb.TritonError.INTERNAL))

    def error(self, exc: BaseException, what: str = "internal error"):
        return self.invalid(str(exc)) if isinstance(exc, CLIENT_ERRORS) else self.internal(exc, what)

    def outputs(self, tensors: dict[str, Any]):
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(k, v) for k, v in tensors.items()])

    def output(self, name: str, value):
        """outputs({name: value}) without the dict: the encoder's one output, once a request."""
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor(name, value)])

    def respond_each(self, responses: list, items, respond: Callable):
        """responses[i] = respond(*args) for each (i, args) of items; a raise costs only that request."""
        for i, args in items:
            try:
                responses[i] = respond(*args)
            except Exception as e:
                responses[i] = self.error(e)

    def parse_each(self, requests, parse: Callable) -> tuple[list, list[tuple[int, Any]]]:
        """(responses: None, or the error response of each request parse(request) raised for;
        [(index, parsed)] of the others)."""
        responses, parsed = [None] * len(requests), []
        for i, req in enumerate(requests):
            try:
                parsed.append((i, parse(req)))
            except Exception as e:  # a bad request, or a bug: either way it costs this request only
                responses[i] = self.error(e)
        return responses, parsed
