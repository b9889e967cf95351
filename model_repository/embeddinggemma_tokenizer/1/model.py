"""Triton adapter: TEXT -> INPUT_IDS / SEQ_LEN with egemma.tokenizer. All texts of all requests in the dynamic
batch go through one batched tokenizer call; a bad request gets its own error, the others their ids.
Request parameters: prompt_name / prompt (prepended, as SentenceTransformer.encode), truncate (false: an
over-long text is an error); every option is parsed here, so malformed ones fail before tokenising."""
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.config import ModelConfig, triton_params
from egemma.metrics import Counters
from egemma.options import OptionError, RequestOptions
from egemma.tokenizer import PromptError, TextTokenizer


def _invalid(message):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))


class TritonPythonModel:
    def initialize(self, args):
        checkpoint, params = triton_params(args["model_config"])
        self.cfg = ModelConfig.load(checkpoint)
        self.tok = TextTokenizer(self.cfg, params.get("tokenizer_json"))
        self.max_text_bytes = int(params.get("max_text_bytes", 1_000_000))
        self.counters = Counters(pb_utils, {"tokenizer_seconds": "Time spent tokenising, seconds",
                                            "texts": "Texts tokenised"})

    def _texts(self, req) -> tuple[list[str], RequestOptions]:
        opts = RequestOptions.parse(req.parameters())
        prefix = self.tok.prefix(opts.prompt_name, opts.prompt)
        out = []
        for j, t in enumerate(pb_utils.get_input_tensor_by_name(req, "TEXT").as_numpy().reshape(-1)):
            raw = t if isinstance(t, bytes) else str(t).encode()
            if len(raw) > self.max_text_bytes:
                raise OptionError(f"text {j} has {len(raw)} bytes, over this server's max_text_bytes "
                                  f"({self.max_text_bytes})")
            try:
                out.append(prefix + raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise OptionError(f"text {j} is not valid UTF-8: {e}") from None
        return out, opts

    def execute(self, requests):
        t0 = time.perf_counter()
        texts, spans, responses = [], [], [None] * len(requests)
        for i, req in enumerate(requests):
            try:
                batch, opts = self._texts(req)
            except (OptionError, PromptError) as e:
                responses[i] = _invalid(str(e))
                continue
            except Exception as e:  # a bug must cost this request only, never the batch
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {e}"))
                continue
            spans.append((i, len(texts), len(texts) + len(batch), opts.truncate))
            texts.extend(batch)
        ids = self.tok.encode(texts)
        for i, a, b, truncate in spans:
            rows = ids[a:b]
            lens = np.array([len(r) for r in rows], dtype=np.int32)
            if not truncate:  # only texts that reached the limit can have been cut
                over = [(j, n) for j in np.flatnonzero(lens == self.tok.max_length)
                        if (n := self.tok.untruncated_length(texts[a + j])) > self.tok.max_length]
                if over:
                    j, n = over[0]
                    responses[i] = _invalid(
                        f"text {j} has {n} tokens, over the {self.tok.max_length}-token limit (truncate=false)")
                    continue
            if len(rows) == 1:  # the common single-text request: no padding to do
                out = rows[0][None]
            else:
                out = np.full((len(rows), int(lens.max(initial=1))), self.cfg.pad_id, dtype=np.int32)
                for j, r in enumerate(rows):
                    out[j, :len(r)] = r
            responses[i] = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("INPUT_IDS", out), pb_utils.Tensor("SEQ_LEN", lens[:, None])])
        self.counters.add(texts=len(texts), tokenizer_seconds=time.perf_counter() - t0)
        return responses
