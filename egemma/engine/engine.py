"""The engine: packs token-id sequences into varlen batches, runs the encoder (CUDA-graph replay on GPU,
eager elsewhere) and returns pooled embeddings. Importable and testable without Triton."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from egemma.engine.config import ModelConfig
from egemma.engine.graphs import GraphRunner, bucket_sizes
from egemma.engine.model import Encoder, Packed
from egemma.kernels.select import ATTENTION_BACKENDS, attention_fn, available_attention_backends, make_ops

log = logging.getLogger("egemma")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class EngineConfig:
    checkpoint: str
    device: str = "auto"  # "auto": the current CUDA device (cuda:N) when present, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on cuda, float32 on cpu. fp16 overflows in Gemma3: refused.
    norm_backend: str = "auto"  # auto (fastest per op, timed at load) | sgl-kernel | triton | native
    attention_backend: str = "auto"  # auto (timed per bucket) | fa3 | fa2 | native
    cuda_graphs: bool = True
    max_tokens: int = 16384  # tokens per forward; the largest graph bucket. Larger batches are split.
    max_seqs: int = 256  # sequences per forward

    @classmethod
    def from_params(cls, checkpoint: str, params: dict[str, str]) -> "EngineConfig":
        """From config.pbtxt string parameters; unknown keys are an error."""
        fields = {f: cls.__dataclass_fields__[f].type for f in cls.__dataclass_fields__ if f != "checkpoint"}
        unknown = set(params) - set(fields)
        if unknown:
            raise ValueError(f"unknown encoder parameters {sorted(unknown)}; known: {sorted(fields)}")
        kw = {}
        for k, v in params.items():
            kw[k] = v.lower() in ("1", "true", "yes") if fields[k] == "bool" else int(v) if fields[k] == "int" else v
        return cls(checkpoint=checkpoint, **kw)


class Engine:
    def __init__(self, ec: EngineConfig):
        t0 = time.perf_counter()
        self.ec = ec
        self.cfg = cfg = ModelConfig.load(ec.checkpoint)
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if ec.device == "auto" else ec.device)
        if device.type == "cuda" and device.index is None:  # concrete, cuda:N: what the logs and the graphs name
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        dtype = ec.dtype if ec.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (choose from {list(DTYPES)}; fp16 overflows)")
        if ec.max_tokens < cfg.max_seq_length:
            raise ValueError(f"max_tokens {ec.max_tokens} < max_seq_length {cfg.max_seq_length}")
        if self.device.type == "cuda" and ec.cuda_graphs:
            # cuBLAS without a workspace: its Hopper GEMMs then take their static-schedule variants, which need no
            # memset before each launch; in a CUDA graph each memset left the GPU idle ~4 us before its GEMM, 72
            # times a forward of 16k tokens, and the variants ran faster besides (perf/RESULTS.md runs 80-83). Eager
            # calls pay on the host for it, hence graphs only. torch reads it at the process's first cuBLAS call
            # (in a model instance, the warm-up below; after one, setting it here changes nothing); a value set
            # before stands.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
        self.model = Encoder(cfg, DTYPES[dtype], self.device)
        if self.device.type == "cuda":  # kernels are chosen by timing below: bring the clocks up first
            x = torch.randn(4096, 4096, device=self.device, dtype=torch.bfloat16)
            for _ in range(200):
                x @ x
            torch.cuda.synchronize(self.device)
        buckets = bucket_sizes(ec.max_tokens)
        self.ops = make_ops(ec.norm_backend, self.device, self.model.dtype, cfg.hidden, cfg.intermediate,
                            ec.max_tokens, buckets, cfg.layers)
        have = available_attention_backends(self.device)
        if ec.attention_backend != "auto" and ec.attention_backend not in have:
            raise RuntimeError(f"attention backend {ec.attention_backend!r} is not available on {self.device} "
                               f"(available: {have}; known: {ATTENTION_BACKENDS})")
        self.attn_candidates = have if ec.attention_backend == "auto" else [ec.attention_backend]
        log.info("egemma: %s on %s %s, norms=%s, attention candidates=%s, CUBLAS_WORKSPACE_CONFIG=%s, loaded in "
                 "%.1fs", cfg.path, self.device, dtype, self.ops.name, self.attn_candidates,
                 os.environ.get("CUBLAS_WORKSPACE_CONFIG"), time.perf_counter() - t0)
        self.graphs = GraphRunner(self.model, self.ops, self.attn_candidates, buckets, ec.max_seqs,
                                  capture=ec.cuda_graphs) if self.device.type == "cuda" else None
        self.stats = {"graph_replays": 0, "eager_runs": 0, "tokens": 0}

    def check(self, ids: np.ndarray, max_len: int | None = None) -> str | None:
        """Why these ids (one sequence, or several rows' ids flattened) cannot be embedded, or None."""
        n = ids.size if max_len is None else max_len
        if ids.ndim != 1 or ids.size == 0:
            return "ids must be 1-D and non-empty"
        if n > self.cfg.max_positions:
            return f"sequence of {n} tokens exceeds the model's {self.cfg.max_positions} positions"
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            return f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {self.cfg.vocab_size})"
        return None

    def chunks(self, lengths: list[int]) -> list[tuple[int, int]]:
        """Consecutive [start, end) ranges of sequences that fit one forward (max_tokens, max_seqs)."""
        out, start, tokens = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and (tokens + n > self.ec.max_tokens or i - start >= self.ec.max_seqs):
                out.append((start, i))
                start, tokens = i, 0
            tokens += n
        if start < len(lengths):
            out.append((start, len(lengths)))
        return out

    @torch.inference_mode()
    def embed(self, seqs: list[np.ndarray]) -> np.ndarray:
        """Embeddings [B, out_dim] fp32 for B id sequences (each already checked)."""
        lengths = [len(s) for s in seqs]
        out = np.empty((len(seqs), self.cfg.out_dim), dtype=np.float32)
        for a, b in self.chunks(lengths):
            ids = np.concatenate(seqs[a:b])
            self.stats["tokens"] += ids.size
            if self.graphs is not None:
                _, replayed = self.graphs.run(ids, lengths[a:b], out=out[a:b])
                self.stats["graph_replays" if replayed else "eager_runs"] += 1
            else:
                self.stats["eager_runs"] += 1
                packed = Packed.from_lengths(torch.from_numpy(ids.astype(np.int64)), lengths[a:b], self.device)
                out[a:b] = self.forward_eager(packed).cpu().numpy()
        return out

    def forward_eager(self, b: Packed) -> torch.Tensor:
        return self.model.embed_packed(b, b.cu_seqlens.shape[0] - 1, self.ops,
                                       (attention_fn(self.attn_candidates[0]),) * 2)
