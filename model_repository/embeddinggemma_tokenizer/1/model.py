"""Triton adapter: TEXT -> INPUT_IDS / SEQ_LEN with egemma.engine.tokenizer. All texts of all requests in the
dynamic batch go through one batched tokenizer call; a bad request gets its own error, the others their ids.
Request parameters: prompt_name / prompt (prepended, as SentenceTransformer.encode), truncate (false: an
over-long text is an error); every option is parsed here, so malformed ones fail before tokenising, and those that
shape the encoder's output leave as OPTIONS (egemma.stub.options.to_tensor), which the response cache keys on."""
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.engine import boot
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import TextTokenizer
from egemma.stub import budget
from egemma.stub.instance import Heartbeat
from egemma.stub.metrics import STUB_FAMILIES, Counters, instance_stats
from egemma.stub.options import OptionError, RequestOptions, allowed_dimensions, check_dimensions, to_tensor
from egemma.stub.adapter import Adapter, setup_logging, triton_params


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        boot.begin(args["model_instance_name"])
        checkpoint, params = triton_params(args["model_config"])
        self.cfg = ModelConfig.load(checkpoint)
        self.tok = TextTokenizer(self.cfg, params.get("tokenizer_json"), params.get("tokenizer_backend", "auto"))
        boot.phase("tokenizer", source=self.tok.source)
        self.max_text_bytes = int(params.get("max_text_bytes", 1_000_000))
        self.max_request_tokens = budget.limit(params.get(budget.PARAMETER, ""))
        # checked here too, not only in the encoder: a request the ensemble refuses never reaches the encoder, whose
        # response cache would keep an error as an empty answer (Triton 2.51; tests/test_response_cache.py)
        self.dims = allowed_dimensions(params.get("matryoshka_dims", ""), self.cfg.out_dim)
        self.a = Adapter(pb_utils)
        self.beat = Heartbeat(args["model_instance_name"])
        self.counters = Counters(pb_utils, {"tokenizer_seconds": "Time spent tokenising, seconds",
                                            "texts": "Texts tokenised"})
        self.stats = instance_stats(args["model_instance_name"], STUB_FAMILIES)  # histograms, read by the gateway
        boot.phase("ready")

    def _texts(self, req) -> tuple[list[str], RequestOptions]:
        opts = RequestOptions.parse(req.parameters())
        check_dimensions(opts, self.dims)
        prefix = self.tok.prefix(opts.prompt_name, opts.prompt)
        # prompt + text is what gets tokenised: together under max_text_bytes (a 20 MB prompt cost seconds of CPU)
        try:
            n_prefix = len(prefix.encode())
        except UnicodeEncodeError as e:
            raise OptionError(f"the prompt is not valid Unicode: {e}") from None
        if n_prefix > self.max_text_bytes:
            raise OptionError(f"the prompt has {n_prefix} bytes, over this server's max_text_bytes "
                              f"({self.max_text_bytes}, prompt and text together)")
        out = []
        for j, t in enumerate(pb_utils.get_input_tensor_by_name(req, "TEXT").as_numpy().reshape(-1)):
            raw = t if isinstance(t, bytes) else str(t).encode()
            if len(raw) + n_prefix > self.max_text_bytes:
                with_prompt = f" + a {n_prefix}-byte prompt" if n_prefix else ""
                raise OptionError(f"text {j} has {len(raw)} bytes{with_prompt}, over this server's max_text_bytes "
                                  f"({self.max_text_bytes})")
            try:
                out.append(prefix + raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise OptionError(f"text {j} is not valid UTF-8: {e}") from None
        return out, opts

    def _encode(self, parsed, responses) -> list:
        """Ids per parsed request: one call for all texts; if the tokenizer raises, request by request, so
        that only the requests it fails on get the error."""
        try:
            ids = self.tok.encode([t for _, (texts, _) in parsed for t in texts])
        except Exception:
            ids = None
        out, k = [], 0
        for i, (texts, _) in parsed:
            if ids is not None:
                out.append(ids[k:k + len(texts)])
                k += len(texts)
                continue
            try:
                out.append(self.tok.encode(texts))
            except Exception as e:
                responses[i] = self.a.internal(e, "tokenizer failure")
                out.append(None)
        return out

    def _response(self, texts: list[str], rows: list[np.ndarray], opts: RequestOptions):
        lens = np.array([len(r) for r in rows], dtype=np.int32)
        budget.check(int(lens.sum()), self.max_request_tokens)
        if not opts.truncate:  # only texts that reached the limit can have been cut
            for j in np.flatnonzero(lens == self.tok.max_length):
                if (n := self.tok.untruncated_length(texts[j])) > self.tok.max_length:
                    return self.a.invalid(f"text {j} has {n} tokens, over the {self.tok.max_length}-token limit "
                                          "(truncate=false)")
        if len(rows) == 1:  # the common single-text request: no padding to do
            ids = rows[0][None]
        else:
            ids = np.full((len(rows), int(lens.max(initial=1))), self.cfg.pad_id, dtype=np.int32)
            for j, r in enumerate(rows):
                ids[j, :len(r)] = r
        return self.a.outputs({"INPUT_IDS": ids, "SEQ_LEN": lens[:, None], "OPTIONS": to_tensor(opts, len(rows))})

    def execute(self, requests):
        with self.beat:  # start/end stamps: the watchdog sees a hung or spinning instance (egemma.stub.instance)
            return self._execute(requests)

    def _execute(self, requests):
        t0 = time.perf_counter()
        responses, parsed = self.a.parse_each(requests, self._texts)
        encoded = [(i, (texts, rows, opts)) for (i, (texts, opts)), rows in zip(parsed, self._encode(parsed, responses))
                   if rows is not None]
        self.a.respond_each(responses, encoded, self._response)
        took = time.perf_counter() - t0
        self.stats.observe("egemma_tokenize_duration_seconds", took)
        self.a.count(self.counters, texts=sum(len(t) for _, (t, _) in parsed), tokenizer_seconds=took)
        return responses
