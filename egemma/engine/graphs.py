"""Whole-forward CUDA graphs (layers + pooling + Dense; L2 normalisation follows on the host), one per (token
bucket, longest-sequence class), captured largest-first into one memory pool. A batch replays the smallest graph
that holds it: the padding tokens form one extra sequence that pooling ignores, and unused sequence slots are empty
(cu_seqlens repeats). Attention's grid follows max_seqlen, so short-sequence batches get graphs with a small
one. The attention backend of each graph and layer type is picked by timing at load (egemma.engine.tuning), and
so is, for the smallest buckets, the layer stack as one kernel (egemma/kernels/layer_stack.py) against the layered
forward."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from egemma.engine.model import Encoder, Packed
from egemma.engine.select import Ops, attention_fn, time_ms

log = logging.getLogger("egemma")

SEQ_CLASSES = (128, 512, 2048)  # graph variants by longest sequence (clipped to the model's positions)


def bucket_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, ... with 1.5x steps from 512 on (less padding where it costs most), up to max_tokens."""
    out, t = [], 16
    while t < max_tokens:
        out.append(t)
        if t >= 512 and t * 3 // 2 < max_tokens:
            out.append(t * 3 // 2)
        t *= 2
    return sorted(set(out + [max_tokens]))


@dataclass
class GraphVars:
    """The graph inputs of one bucket: named views of one int64 buffer, so a batch costs one host->device copy."""
    ids: torch.Tensor  # [t]
    pos: torch.Tensor  # [t]
    cu_seqlens: torch.Tensor  # int32 [slots + 2]: the sequences, the padding sequence, and its end
    size: int  # elements used


class GraphRunner:
    def __init__(self, model: Encoder, buckets: list[int], max_seqs: int):
        """The graphs' input and output buffers; setup() captures them once the kernels are chosen."""
        self.model, self.buckets, self.max_seqs = model, buckets, max_seqs
        c, dev = model.cfg, model.device
        self.classes = sorted({min(m, c.max_positions) for m in SEQ_CLASSES} | {c.max_positions})
        size = 2 * buckets[-1] + max_seqs + 2
        self.meta = torch.zeros(size, dtype=torch.int64, device=dev)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        # numpy views of each bucket's staged inputs, made once: a query's host work before its replay is what a
        # stub woken from its wait pays several times over
        self.staged = {t: (v.ids.numpy(), v.pos.numpy(), v.cu_seqlens.numpy())
                       for t in buckets for v in [self.vars(self.staging, t)]}
        self.arange = np.arange(buckets[-1], dtype=np.int64)
        # the embeddings come back through pinned memory: a pageable .cpu() was slower
        self.results = torch.zeros((max_seqs, c.out_dim), dtype=torch.float32, pin_memory=True)
        self.keys = [(t, m) for t in buckets for m in sorted({min(m, t) for m in self.classes})]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.ops, self.attn, self.stack, self.capture_s = None, {}, set(), 0.0

    @staticmethod
    def name(key: tuple[int, int]) -> str:
        return f"{key[0]}/{key[1]}"

    def setup(self, ops: Ops, attention: dict[str, list[str]], stack: list[str], capture: bool):
        """The chosen kernels (egemma.engine.tuning.Choices: attention per graph name, the graphs run as the layer
        stack); capture: every graph now (attention chosen: native attention syncs, so it has none)."""
        self.ops = ops
        self.attn = {k: tuple(attention.get(self.name(k), ("native", "native"))) for k in self.keys}
        self.stack = {k for k in self.keys if self.name(k) in stack}
        if capture and attention:
            self.capture_s = self._capture()

    def slots(self, t: int) -> int:
        return min(self.max_seqs, t)

    def vars(self, buf: torch.Tensor, t: int) -> GraphVars:
        # cu_seqlens as int32 pairs in the int64 buffer: what attention and pooling read, with no conversion kernel
        # in the graph
        n = (self.slots(t) + 3) // 2
        return GraphVars(buf[:t], buf[t:2 * t], buf[2 * t:2 * t + n].view(torch.int32)[:self.slots(t) + 2],
                         2 * t + n)

    def _capture(self) -> float:
        """Every graph, largest first so that the smaller ones reuse its memory pool; returns the seconds taken."""
        t0, pool = time.perf_counter(), None
        dev = self.model.device
        before = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev),
                  torch.cuda.max_memory_allocated(dev))  # the weights, and the kernel choice's leftovers and peak
        # One side stream for every warm-up and capture: cuBLAS, when it has a workspace (the engine's default is
        # none), keeps 32 MiB of it per stream for good, and a fresh stream per graph held 1.03 GiB of them (the
        # per-instance memory budget).
        s = torch.cuda.Stream(dev)
        for k in reversed(self.keys):
            self._fill_dummy(k)
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self._forward(k)  # warm-up: lazy inits and workspace allocations stay out of the graph
            s.synchronize()  # its copy has read the staged inputs before the next bucket's overwrite them
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=s):
                out = self._forward(k)
            pool = g.pool()
            self.graphs[k] = (g, out)
            if len(self.graphs) % 8 == 0 or len(self.graphs) == len(self.keys):
                log.info("egemma: captured %d/%d CUDA graphs", len(self.graphs), len(self.keys))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the kernel choice's and the warm-ups' blocks: only the graphs' pool is used now
        took = time.perf_counter() - t0
        gib = 2 ** -30  # what each stage holds, for the per-instance memory budget (perf/RESULTS.md, Memory)
        log.info("egemma: %d CUDA graphs captured in %.1fs; GPU memory allocated %.2f -> %.2f GiB, reserved %.2f -> "
                 "%.2f GiB, peak %.2f -> %.2f GiB", len(self.graphs), took, before[0] * gib,
                 torch.cuda.memory_allocated(dev) * gib, before[1] * gib, torch.cuda.memory_reserved(dev) * gib,
                 before[2] * gib, torch.cuda.max_memory_allocated(dev) * gib)
        return took

    def _upload(self, t: int) -> GraphVars:
        """Bucket t's inputs on the GPU, copied from the pinned staging buffer in stream order (in a graph, when
        the graph runs)."""
        v = self.vars(self.meta, t)
        self.meta[:v.size].copy_(self.staging[:v.size], non_blocking=True)
        return v

    def _forward(self, key: tuple[int, int], ops: Ops | None = None, attn: tuple[str, str] | None = None,
                 stack: bool | None = None) -> torch.Tensor:
        """The forward from the staged inputs, their copy to the GPU first: inside each graph, so that a replay is
        one launch. ops, attn (sliding, global), stack (the layers as one kernel): as chosen, unless given."""
        t, m = key
        v = self._upload(t)
        a = attn or self.attn[key]
        b = Packed(v.ids, v.pos, v.cu_seqlens, m)
        return self.model.embed_packed(b, self.slots(t), ops or self.ops, (attention_fn(a[0]), attention_fn(a[1])),
                                       key in self.stack if stack is None else stack)

    def _fill(self, t: int, ids: np.ndarray, lengths: list[int]):
        B, T = len(lengths), ids.size
        ids_, pos, cu = self.staged[t]
        ids_[:T] = ids
        ids_[T:] = self.model.cfg.pad_id
        cu[0] = 0
        np.cumsum(lengths, out=cu[1:B + 1])
        cu[B + 1:] = T
        cu[-1] = t  # the padding tokens [T, t) are one more sequence, which pooling skips (past the slots)
        if B == 1:  # one query: a slice, ~1 us less than the repeat
            pos[:T] = self.arange[:T]
        else:
            np.subtract(self.arange[:T], np.repeat(cu[:B], lengths), out=pos[:T])
        pos[T:] = 0

    def _fill_dummy(self, key: tuple[int, int]):
        t, m = key
        lengths = [m] * (t // m)
        self._fill(t, np.random.default_rng(0).integers(4, self.model.cfg.vocab_size, sum(lengths)), lengths)

    def key(self, n_tokens: int, max_len: int) -> tuple[int, int]:
        t = next(t for t in self.buckets if t >= n_tokens)
        return t, min(next(m for m in self.classes if m >= max_len), t)

    def run(self, ids: np.ndarray, lengths: list[int], use_graph: bool = True,
            out: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """(embeddings [len(lengths), out_dim] fp32, written into out if given, whether a graph was replayed)."""
        k = self.key(ids.size, max(lengths))
        self._fill(k[0], ids, lengths)  # staging is free: the previous run waited for its graph
        replay = use_graph and k in self.graphs
        if replay:
            g, emb = self.graphs[k]
            g.replay()
        else:
            emb = self._forward(k)
        n = len(lengths)
        self.results[:n].copy_(emb[:n], non_blocking=True)
        torch.cuda.current_stream(self.model.device).synchronize()
        out = np.empty((n, emb.shape[1]), dtype=np.float32) if out is None else out
        np.copyto(out, self.results[:n].numpy())
        return out, replay

    # The timers egemma.engine.tuning chooses with: each on a full batch of the graph's shape.
    def stack_supported(self, key: tuple[int, int]) -> bool:
        """Whether the layer stack kernel can run this graph: bf16 and a GPU and model shape it supports."""
        from egemma.kernels import layer_stack
        c = self.model.cfg
        return self.model.dtype == torch.bfloat16 and layer_stack.supported(
            self.model.device, c.hidden, c.intermediate, c.heads, c.kv_heads, c.head_dim)

    def forward_ms(self, key: tuple[int, int], ops: Ops, attn: tuple[str, str], stack: bool) -> float:
        """GPU ms of this graph's whole forward, captured as a graph."""
        self._fill_dummy(key)
        return time_ms(lambda: self._forward(key, ops, attn, stack))

    def attention_ms(self, key: tuple[int, int], ops: Ops, cands: list[str], sliding: bool) -> dict[str, float]:
        """GPU ms of each backend's attention in this graph, sliding or global, on q / k / v exactly as the forward
        makes them (by qk_norm_rope from the qkv GEMM's output): on other layouts the ranking came out differently."""
        c, L = self.model.cfg, self.model.layers[0]
        t, m = key
        self._fill_dummy(key)
        v = self._upload(t)  # the staging buffer is refilled only after the timing below has synchronised
        qkv = torch.randn(t, (c.heads + 2 * c.kv_heads) * c.head_dim, device=self.model.device, dtype=self.model.dtype)
        q, k, vv = ops.qk_norm_rope(qkv, v.pos, L.q_norm, L.k_norm, *self.model.rope[True], c.heads, c.kv_heads,
                                    c.eps, torch.ones(t, device=qkv.device))
        w = c.window if sliding else -1
        return {b: time_ms(attention_fn(b), q, k, vv, v.cu_seqlens, m, w, c.attn_scale) for b in cands}
