"""Whole-forward CUDA graphs (layers + pooling + Dense + normalise), one per (token bucket, longest-sequence
class), captured largest-first into one memory pool. A batch replays the smallest graph that holds it: the
padding tokens form one extra sequence that pooling ignores, and unused sequence slots are empty
(cu_seqlens repeats). Attention's grid follows max_seqlen, so short-sequence batches get graphs with a small
one. The attention backend of each graph and layer type is picked by timing at load (egemma.kernels.select), and
so is, for the smallest buckets, the layer stack as one kernel (kernels/layer_stack.py) against the layered forward."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from egemma.engine.model import Encoder, Packed
from egemma.kernels.select import Ops, attention_fn, pick_attention, time_ms

log = logging.getLogger("egemma")

SEQ_CLASSES = (128, 512, 2048)  # graph variants by longest sequence (clipped to the model's positions)
# Buckets offered the layer stack as one kernel (kernels/layer_stack.py): it won at 16 tokens and lost by half at 32
# (perf/RESULTS.md runs 86-87); the choice is still timed at load.
STACK_TOKENS = 16


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
    def __init__(self, model: Encoder, ops: Ops, attention: list[str], buckets: list[int], max_seqs: int,
                 capture: bool = True):
        """attention: the candidate backends; each graph gets the fastest per layer type."""
        self.model, self.ops, self.buckets, self.max_seqs = model, ops, buckets, max_seqs
        c, dev = model.cfg, model.device
        self.classes = sorted({min(m, c.max_positions) for m in SEQ_CLASSES} | {c.max_positions})
        size = 2 * buckets[-1] + max_seqs + 2
        self.meta = torch.zeros(size, dtype=torch.int64, device=dev)
        self.staging = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        # numpy views of each bucket's staged inputs, made once: a query's host work before its replay is what a
        # stub woken from its wait pays several times over (perf/RESULTS.md run 92)
        self.staged = {t: (v.ids.numpy(), v.pos.numpy(), v.cu_seqlens.numpy())
                       for t in buckets for v in [self.vars(self.staging, t)]}
        self.arange = np.arange(buckets[-1], dtype=np.int64)
        # the embeddings come back through pinned memory: a pageable .cpu() took ~0.07 ms more at 1 x 16 (perf/
        # RESULTS.md run 87)
        self.results = torch.zeros((max_seqs, c.out_dim), dtype=torch.float32, pin_memory=True)
        self.keys = [(t, m) for t in buckets for m in sorted({min(m, t) for m in self.classes})]
        cands = [b for b in attention if b != "native"]  # native attention syncs: not capturable
        self.attn = {k: self._pick_attention(k, cands) if cands else ("native", "native") for k in self.keys}
        log.info("egemma: attention per (tokens, max_seqlen) -> (sliding, global): %s",
                 ", ".join(f"{t}/{m}:{a[0]}/{a[1]}" for (t, m), a in self.attn.items()))
        timed = capture and bool(cands)  # both choices are timed as CUDA graphs
        self.stack = {k: timed and self._pick_stack(k) for k in self.keys}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = self._capture() if capture and cands else 0.0

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
        # none), keeps 32 MiB of it per stream for good, and a fresh stream per graph held 1.03 GiB of them (issue
        # #12's per-instance memory; perf/RESULTS.md run 32).
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
        gib = 2 ** -30  # what each stage holds, for the per-instance memory budget (perf/RESULTS.md, issue #12)
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

    def _forward(self, key: tuple[int, int], stack: bool | None = None) -> torch.Tensor:
        """The forward from the staged inputs, their copy to the GPU first: inside each graph, so that a replay is
        one launch. stack: the layers as one kernel (default: as chosen for this graph)."""
        t, m = key
        v = self._upload(t)
        a = self.attn[key]
        b = Packed(v.ids, v.pos, v.cu_seqlens, m)
        return self.model.embed_packed(b, self.slots(t), self.ops, (attention_fn(a[0]), attention_fn(a[1])),
                                       self.stack[key] if stack is None else stack)

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

    def _pick_stack(self, key: tuple[int, int]) -> bool:
        """Whether this graph runs the layer stack as one kernel: bf16, at most STACK_TOKENS tokens, a GPU and model
        shape it supports, and faster than the layered forward, each timed as graphs of the whole forward."""
        from egemma.kernels import layer_stack
        c = self.model.cfg
        if key[0] > STACK_TOKENS or self.model.dtype != torch.bfloat16 or not layer_stack.supported(
                self.model.device, c.hidden, c.intermediate, c.heads, c.kv_heads, c.head_dim):
            return False
        self._fill_dummy(key)
        ms = {s: time_ms(lambda s=s: self._forward(key, s)) for s in (False, True)}
        log.info("egemma: %d tokens: the layer stack as one kernel %.3f ms, layered %.3f ms a forward -> %s", key[0],
                 ms[True], ms[False], "one kernel" if ms[True] < ms[False] else "layered")
        return ms[True] < ms[False]

    def _pick_attention(self, key: tuple[int, int], cands: list[str]) -> tuple[str, str]:
        """(sliding, global) backends for this graph, timed on a full batch of it."""
        if len(cands) == 1:
            return cands[0], cands[0]
        c, L = self.model.cfg, self.model.layers[0]
        t, m = key
        self._fill_dummy(key)
        v = self._upload(t)  # the staging buffer is refilled only after the timing below has synchronised
        qkv = torch.randn(t, (c.heads + 2 * c.kv_heads) * c.head_dim, device=self.model.device, dtype=self.model.dtype)
        q, k, vv = self.ops.qk_norm_rope(qkv, v.pos, L.q_norm, L.k_norm, *self.model.rope[True], c.heads,
                                         c.kv_heads, c.eps, torch.ones(t, device=qkv.device))
        cu = v.cu_seqlens
        return tuple(pick_attention(cands, q, k, vv, cu, m, w, c.attn_scale) for w in (c.window, -1))
