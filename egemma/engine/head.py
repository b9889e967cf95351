"""The sentence-transformers modules after the encoder: mean pooling per sequence, the Dense projector
(768 -> 3072 -> 768 for EmbeddingGemma) and L2 normalisation, all in fp32 whatever the encoder's dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from egemma.engine.config import ModelConfig
from egemma.engine.weights import check, read_safetensors
from egemma.kernels.select import Ops


class Head:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.normalize = cfg.normalize
        self.dense = []  # [(weight [out, in], bias [out] or None)] fp32
        for d in cfg.dense:
            path = d.path / "model.safetensors"
            w = read_safetensors(path, prefixes=("",))
            want = {"linear.weight": (d.out_features, d.in_features)}
            if d.bias:
                want["linear.bias"] = (d.out_features,)
            check(path, w, want)
            self.dense.append((w["linear.weight"].float().to(device),
                               w["linear.bias"].float().to(device) if d.bias else None))

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor, n: int, ops: Ops) -> torch.Tensor:
        """x [T, D] -> fp32 [n, out_dim]: the mean over each of the first n sequences' rows (rows past
        cu_seqlens[n], graph padding that may never have been written, are not read), Dense, L2 norm."""
        e = ops.mean_pool(x, cu_seqlens, n)
        for w, bias in self.dense:
            e = F.linear(e, w, bias)
        return F.normalize(e, dim=-1) if self.normalize else e
