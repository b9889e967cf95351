"""The floor for perf/serving/bench_serve.py --floor: stands in for both the tokenizer and the encoder model and does
nothing (fixed ids, zero embeddings), so the same ensemble, configs and instance counts measure what Triton, the
ensemble and the Python backend alone cost per request on a host. With the encoder's config parameter
`floor_wait_us` (bench_serve.py --floor-wait) each encoder execute first sleeps that long, as ours waits for its
GPU: what a wait per batch costs the serial path through each instance, with nothing else of ours in it."""
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.encoder = args["model_name"].endswith("encoder")
        params = json.loads(args["model_config"]).get("parameters", {})
        self.wait = float(params.get("floor_wait_us", {}).get("string_value") or 0) * 1e-6

    def execute(self, requests):
        if self.wait:
            time.sleep(self.wait)
        out = []
        for r in requests:
            n = r.inputs()[0].shape()[0]
            if self.encoder:
                tensors = [pb_utils.Tensor("EMBEDDING", np.zeros((n, 768), np.float32))]
            else:
                tensors = [pb_utils.Tensor("INPUT_IDS", np.full((n, 2), 2, np.int32)),
                           pb_utils.Tensor("SEQ_LEN", np.full((n, 1), 2, np.int32))]
            out.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return out
