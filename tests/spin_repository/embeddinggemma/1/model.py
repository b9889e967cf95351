"""TEXT -> a fixed unit EMBEDDING, except that "spin" loops on the CPU forever and "hang" sleeps forever. Stamps
the execute heartbeat as the real models do (egemma.serving.instance), so the watchdog sees which instance is
stuck."""
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from egemma.serving.instance import Heartbeat


class TritonPythonModel:
    def initialize(self, args):
        self.beat = Heartbeat(args["model_instance_name"])

    def execute(self, requests):
        self.beat.begin()
        try:
            return [self._one(req) for req in requests]
        finally:
            self.beat.end()

    def _one(self, req):
        texts = pb_utils.get_input_tensor_by_name(req, "TEXT").as_numpy().reshape(-1).tolist()
        if b"spin" in texts:
            while True:
                pass
        if b"hang" in texts:
            threading.Event().wait()
        emb = np.full((len(texts), 4), 0.5, dtype=np.float32)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", emb)])
