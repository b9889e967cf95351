"""The engine: packs token-id sequences into varlen batches, runs the encoder (CUDA-graph replay on GPU,
eager elsewhere) and returns pooled embeddings, the windows of long texts combined (egemma.engine.windows).
Importable and testable without Triton."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from egemma.engine.config import EngineConfig, ModelConfig
from egemma.engine.graphs import GraphRunner, bucket_sizes
from egemma.engine.ids import problem
from egemma.engine.model import Encoder, Packed
from egemma.engine.process import cache_dir
from egemma.engine import tuning
from egemma.engine.select import ATTENTION_BACKENDS, Ops, attention_fn, available_attention_backends, build_ops
from egemma.engine.windows import combine, normalized

log = logging.getLogger("egemma")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
EAGER_ROWS = 16


def placement(ec: EngineConfig) -> tuple[torch.device, str]:
    """The device (concrete, cuda:N: what the logs and the graphs name) and dtype name that ec asks for."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if ec.device == "auto" else ec.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = ec.dtype if ec.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported (choose from {list(DTYPES)}; fp16 overflows)")
    return device, dtype


def attention_candidates(device: torch.device, backend: str) -> list[str]:
    """The attention backends the kernel choice may time: every one available, or the one asked for."""
    have = available_attention_backends(device)
    if backend != "auto" and backend not in have:
        raise RuntimeError(f"attention backend {backend!r} is not available on {device} (available: {have}; known: "
                           f"{ATTENTION_BACKENDS})")
    return have if backend == "auto" else [backend]


class Engine:
    def __init__(self, ec: EngineConfig):
        """The boot, top-down: the model on its device, its kernels chosen (read from the tuning file, else timed),
        the CUDA graphs captured with them."""
        t0 = time.perf_counter()
        self.ec = ec
        self.cfg = ModelConfig.load(ec.checkpoint)
        self.device, self.dtype = placement(ec)
        if ec.max_tokens < self.cfg.max_seq_length:
            raise ValueError(f"max_tokens {ec.max_tokens} < max_seq_length {self.cfg.max_seq_length}")
        self.model = self.load()
        self.attn_candidates = attention_candidates(self.device, ec.attention_backend)
        self.buckets = bucket_sizes(ec.max_tokens)
        self.graphs = GraphRunner(self.model, self.buckets, ec.max_seqs) if self.device.type == "cuda" else None
        t1 = time.perf_counter()
        self.choices, self.ops = self.choose_kernels()
        t2 = time.perf_counter()
        self.capture()
        log.info("egemma: %s on %s %s, deterministic=%s, %s, CUBLAS_WORKSPACE_CONFIG=%s; load %.1fs, kernel choice "
                 "%.1fs, graphs %.1fs", self.cfg.path, self.device, self.dtype, ec.deterministic,
                 self.choices.summary(), tuning.cublas_workspace(), t1 - t0, t2 - t1,
                 time.perf_counter() - t2)
        self.stats = {"graph_replays": 0, "eager_runs": 0}

    def load(self) -> Encoder:
        """The encoder's weights on the device, the process's GPU settings made before its first cuBLAS call."""
        tuning.gpu_settings(self.device, self.ec.cuda_graphs)
        model = Encoder(self.cfg, DTYPES[self.dtype], self.device)
        # the Dense GEMM on one row count whatever the batch: its rows' bits then never depend on the batch
        model.head.rows = self.ec.max_seqs if self.ec.deterministic else 0
        return model

    def choose_kernels(self) -> tuple[tuning.Choices, Ops]:
        """Every load-time kernel choice, read from the tuning file this setup shares, else timed here and saved."""
        ec = self.ec
        fp = tuning.fingerprint(self.device, dtype=self.dtype, shape=self.cfg.shape(), max_tokens=ec.max_tokens,
                                max_seqs=ec.max_seqs, deterministic=ec.deterministic, norm_backend=ec.norm_backend,
                                attention=self.attn_candidates)
        choices = tuning.settle(fp, cache_dir(), lambda: tuning.tune(
            self.model, self.graphs, self.buckets, self.attn_candidates, ec.max_tokens, ec.norm_backend,
            ec.deterministic))
        return choices, build_ops(choices.norms, choices.mlp_up, self.device, self.model.dtype, self.cfg.hidden,
                                  self.buckets, ec.deterministic)

    def capture(self):
        """Every CUDA graph, with the chosen kernels (on a GPU, unless cuda_graphs is off)."""
        if self.graphs is not None:
            self.graphs.setup(self.ops, self.choices.attention, self.choices.stack, self.ec.cuda_graphs)

    def check(self, ids: np.ndarray, longest: int | None = None) -> str | None:
        """Why these ids (one sequence, or several rows' ids flattened, the longest row `longest` long) cannot be
        embedded, or None (egemma.engine.ids, the id rule)."""
        return problem(ids, self.cfg.vocab_size, self.cfg.max_positions, longest)

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

    def embed(self, seqs: list[np.ndarray], counts: list[int] | None = None) -> np.ndarray:
        """Embeddings [n, out_dim] fp32 of the texts of B id sequences (each already checked): one text per sequence,
        or with counts, text t the next counts[t] sequences, the windows of a long text, combined."""
        x = self.vectors(seqs)
        return self.finish(x if counts is None else combine(x, [len(s) for s in seqs], counts))

    def finish(self, x: np.ndarray) -> np.ndarray:
        """Vectors (the Dense projector's, or their combination) as embeddings: L2-normalised where the checkpoint
        normalises."""
        return normalized(x) if self.cfg.normalize else x

    @torch.inference_mode()
    def vectors(self, seqs: list[np.ndarray]) -> np.ndarray:
        """The Dense projector's outputs [B, out_dim] fp32 (before L2 normalisation) for B id sequences (each
        already checked), in one varlen pass (split where over max_tokens / max_seqs)."""
        lengths = [len(s) for s in seqs]
        out = np.empty((len(seqs), self.cfg.out_dim), dtype=np.float32)
        for a, b in self.chunks(lengths):
            ids = np.concatenate(seqs[a:b])
            if self.graphs is not None:
                _, replayed = self.graphs.run(ids, lengths[a:b], out=out[a:b])
                self.stats["graph_replays" if replayed else "eager_runs"] += 1
            else:
                self.stats["eager_runs"] += 1
                out[a:b] = self.forward_eager(ids, lengths[a:b]).cpu().numpy()
        return out

    def forward_eager(self, ids: np.ndarray, lengths: list[int]) -> torch.Tensor:
        """fp32 [len(lengths), out_dim] without graphs (the CPU's path). Deterministic: the tokens padded to a multiple
        of EAGER_ROWS by one more sequence, which pooling skips: the CPU's GEMMs give a row the same bits at any such
        row count, not at a few rows."""
        n, pad = len(lengths), (-ids.size) % EAGER_ROWS if self.ec.deterministic else 0
        if pad:
            ids, lengths = np.concatenate([ids, np.full(pad, self.cfg.pad_id, ids.dtype)]), [*lengths, pad]
        b = Packed.from_lengths(torch.from_numpy(ids.astype(np.int64)), lengths, self.device)
        return self.model.embed_packed(b, n, self.ops, (attention_fn(self.attn_candidates[0]),) * 2)
