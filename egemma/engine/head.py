"""The sentence-transformers modules after the encoder: mean pooling per sequence and the Dense projector
(768 -> 3072 -> 768 for EmbeddingGemma), in fp32 whatever the encoder's dtype. L2 normalisation follows on the host
(egemma.engine.Engine.embed), after the windows of a long text are combined (egemma.engine.windows)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from egemma.engine.config import ModelConfig
from egemma.engine.weights import check, read_safetensors
from egemma.engine.select import Ops


class Head:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        # The Dense layers have no activation (egemma.engine.config refuses any other): their chain is one affine map,
        # multiplied out at load in fp64. EmbeddingGemma's 768 -> 3072 -> 768 becomes one 768 x 768 GEMM, 8x fewer
        # FLOPs and weight bytes, the same function to fp32 rounding.
        w = b = None  # [out, in], [out] fp64
        for d in cfg.dense:
            path = d.path / "model.safetensors"
            t = read_safetensors(path, prefixes=("",))
            want = {"linear.weight": (d.out_features, d.in_features)}
            if d.bias:
                want["linear.bias"] = (d.out_features,)
            check(path, t, want)
            wd = t["linear.weight"].double()
            bd = t["linear.bias"].double() if d.bias else None
            b = bd if b is None else b @ wd.T + (0.0 if bd is None else bd)
            w = wd if w is None else wd @ w
        self.dense = (None if w is None else w.float().to(device), None if b is None else b.float().to(device))
        self.rows = 0  # > 0: the Dense GEMM always on this many rows (zeros past n), so no row's bits follow n

    def __call__(self, x: torch.Tensor, cu_seqlens: torch.Tensor, n: int, ops: Ops) -> torch.Tensor:
        """x [T, D] -> fp32 [n, out_dim]: the mean over each of the first n sequences' rows (rows past
        cu_seqlens[n], graph padding that may never have been written, are not read), then Dense."""
        e = ops.mean_pool(x, cu_seqlens, n)
        if self.dense[0] is not None:
            e = F.linear(F.pad(e, (0, 0, 0, self.rows - n)) if n < self.rows else e, *self.dense)[:n]
        return e
