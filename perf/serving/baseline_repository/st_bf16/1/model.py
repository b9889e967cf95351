"""SentenceTransformer(checkpoint).encode in bf16 on the GPU, all texts of the dynamic batch in one call."""
import torch
import triton_python_backend_utils as pb_utils
from sentence_transformers import SentenceTransformer

from egemma.stub.adapter import triton_params


class TritonPythonModel:
    def initialize(self, args):
        checkpoint, _ = triton_params(args["model_config"])
        device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke tests only
        self.model = SentenceTransformer(checkpoint, device=device).to(torch.bfloat16)

    def execute(self, requests):
        texts, spans = [], []
        for req in requests:
            rows = pb_utils.get_input_tensor_by_name(req, "TEXT_UTF8").as_numpy()
            try:
                batch = [r.tobytes().rstrip(b"\0").decode("utf-8") for r in rows]
            except UnicodeDecodeError as e:  # seen on the GPU host only (perf/RESULTS.md, peers): say what came
                raise ValueError(f"{e}; rows {rows.shape} {rows.dtype} strides {rows.strides}, the first bytes of "
                                 f"each: {[bytes(r[:8]) for r in rows[:4]]}") from None
            spans.append((len(texts), len(texts) + len(batch)))
            texts.extend(batch)
        emb = self.model.encode(texts, batch_size=len(texts), convert_to_numpy=True).astype("float32")
        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("EMBEDDING", emb[a:b])]) for a, b in spans]
