"""TEXT -> a fixed unit EMBEDDING, except that "spin" loops on the CPU forever ("spin:N" after saying its execute
embeds N tokens, as a large batch would) and "hang" sleeps forever. Stamps the execute heartbeat as the real
models do (egemma.stub.instance), so the watchdog sees which instance is stuck."""
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.stub.instance import Heartbeat


class TritonPythonModel:
    def initialize(self, args):
        self.beat = Heartbeat(args["model_instance_name"])

    def execute(self, requests):
        with self.beat:
            return [self._one(req) for req in requests]

    def _one(self, req):
        texts = pb_utils.get_input_tensor_by_name(req, "TEXT").as_numpy().reshape(-1).tolist()
        for t in texts:
            if t.startswith(b"spin"):
                self.beat.tokens(int(t.partition(b":")[2] or 0))
                while True:
                    pass
        if b"hang" in texts:
            threading.Event().wait()
        emb = np.full((len(texts), 4), 0.5, dtype=np.float32)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", emb)])
