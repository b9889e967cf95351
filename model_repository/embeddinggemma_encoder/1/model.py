"""Triton adapter: INPUT_IDS [n, L] (+ SEQ_LEN [n, 1]) -> EMBEDDING [n, D] with egemma.runner.Engine.
Every row of every request in the dynamic batch is packed into one varlen token batch; a malformed request
gets its own error and never fails the others."""
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.config import triton_params
from egemma.runner import Engine, EngineConfig


class TritonPythonModel:
    def initialize(self, args):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        checkpoint, params = triton_params(args["model_config"])
        if args.get("model_instance_kind") == "GPU":
            params.setdefault("device", f"cuda:{args['model_instance_device_id']}")
        self.engine = Engine(EngineConfig.from_params(checkpoint, params))

    def _rows(self, req) -> list[np.ndarray]:
        ids = pb_utils.get_input_tensor_by_name(req, "INPUT_IDS").as_numpy()
        if ids.ndim != 2:
            raise ValueError(f"INPUT_IDS must be [batch, tokens], got shape {list(ids.shape)}")
        sl = pb_utils.get_input_tensor_by_name(req, "SEQ_LEN")
        lens = sl.as_numpy().reshape(-1) if sl is not None else np.full(ids.shape[0], ids.shape[1])
        if lens.shape[0] != ids.shape[0]:
            raise ValueError(f"SEQ_LEN has {lens.shape[0]} rows, INPUT_IDS {ids.shape[0]}")
        rows = []
        for j, n in enumerate(lens.tolist()):
            if not 1 <= n <= ids.shape[1]:
                raise ValueError(f"SEQ_LEN[{j}] = {n} is outside [1, {ids.shape[1]}]")
            rows.append(ids[j, :n])
            why = self.engine.check(rows[-1])
            if why:
                raise ValueError(f"row {j}: {why}")
        return rows

    def execute(self, requests):
        seqs, spans, responses = [], [], [None] * len(requests)
        for i, req in enumerate(requests):
            try:
                rows = self._rows(req)
            except ValueError as e:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
                continue
            spans.append((i, len(seqs), len(seqs) + len(rows)))
            seqs.extend(rows)
        try:
            emb = self.engine.embed(seqs)
        except Exception as e:  # an engine fault fails this batch's requests cleanly, not the stub
            logging.getLogger("egemma").exception("engine failure")
            for i, _, _ in spans:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"engine failure: {e}"))
            return responses
        for i, a, b in spans:
            responses[i] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", emb[a:b])])
        return responses
