"""TEXT -> a fixed unit EMBEDDING, except that "spin" loops on the CPU forever and "hang" sleeps forever."""
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for req in requests:
            texts = pb_utils.get_input_tensor_by_name(req, "TEXT").as_numpy().reshape(-1).tolist()
            if b"spin" in texts:
                while True:
                    pass
            if b"hang" in texts:
                threading.Event().wait()
            emb = np.full((len(texts), 4), 0.5, dtype=np.float32)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", emb)]))
        return responses
