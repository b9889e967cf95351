"""Triton adapter: TEXT -> INPUT_IDS / SEQ_LEN with egemma.tokenizer. All texts of all requests in the dynamic
batch go through one batched tokenizer call; a bad request gets its own error, the others their ids."""
import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.config import ModelConfig, triton_params
from egemma.tokenizer import TextTokenizer


class TritonPythonModel:
    def initialize(self, args):
        checkpoint, params = triton_params(args["model_config"])
        self.cfg = ModelConfig.load(checkpoint)
        self.tok = TextTokenizer(self.cfg, params.get("tokenizer_json"))

    def execute(self, requests):
        texts, spans, errors = [], [], [None] * len(requests)
        for i, req in enumerate(requests):
            try:
                raw = pb_utils.get_input_tensor_by_name(req, "TEXT").as_numpy().reshape(-1)
                batch = [t.decode("utf-8") if isinstance(t, bytes) else str(t) for t in raw]
            except UnicodeDecodeError as e:
                errors[i] = f"TEXT is not valid UTF-8: {e}"
                continue
            spans.append((i, len(texts), len(texts) + len(batch)))
            texts.extend(batch)
        ids = self.tok.encode(texts)
        responses = [None] * len(requests)
        for i, a, b in spans:
            rows = ids[a:b]
            lens = np.array([len(r) for r in rows], dtype=np.int32)
            out = np.full((len(rows), int(lens.max(initial=1))), self.cfg.pad_id, dtype=np.int32)
            for j, r in enumerate(rows):
                out[j, :len(r)] = r
            responses[i] = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("INPUT_IDS", out), pb_utils.Tensor("SEQ_LEN", lens[:, None])])
        for i, msg in enumerate(errors):
            if msg is not None:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(msg))
        return responses
