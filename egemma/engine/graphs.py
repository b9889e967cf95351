"""Whole-forward CUDA graphs (layers + pooling + Dense + normalise), one per (token bucket, longest-sequence
class), captured largest-first into one memory pool. A batch replays the smallest graph that holds it: the
padding tokens form one extra sequence that pooling ignores, and unused sequence slots are empty
(cu_seqlens repeats). Attention's grid follows max_seqlen, so short-sequence batches get graphs with a small
one. The attention backend of each graph and layer type is picked by timing at load."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from egemma.engine.model import Packed
from egemma.kernels.select import attention_fn

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


class GraphRunner:
    def __init__(self, engine, capture: bool = True):
        self.e = e = engine
        dev = e.device
        self.buckets = bucket_sizes(e.ec.max_tokens)
        self.classes = sorted({min(c, e.cfg.max_positions) for c in SEQ_CLASSES} | {e.cfg.max_positions})
        T, S = self.buckets[-1], e.ec.max_seqs
        # All per-batch metadata in one int64 buffer, so a batch costs one host->device copy:
        # [ids (t) | pos (t) | cu_seqlens (slots + 2)], laid out per bucket t.
        self.meta = torch.zeros(2 * T + S + 2, dtype=torch.int64, device=dev)
        self.staging = torch.zeros(2 * T + S + 2, dtype=torch.int64, pin_memory=True)
        self.keys = [(t, m) for t in self.buckets for m in sorted({min(m, t) for m in self.classes})]
        cands = [b for b in e.attn_candidates if b != "native"]  # native attention syncs: not capturable
        self.capture = capture and bool(cands)
        self.attn = {k: self._pick_attention(k, cands) if cands else ("native", "native") for k in self.keys}
        log.info("egemma: attention per (tokens, max_seqlen) -> (sliding, global): %s",
                 ", ".join(f"{t}/{m}:{a[0]}/{a[1]}" for (t, m), a in self.attn.items()))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        if self.capture:
            t0 = time.perf_counter()
            pool = None
            for k in reversed(self.keys):
                self._fill_dummy(k)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    self._forward(k)  # warm-up: lazy inits and workspace allocations stay out of the graph
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._forward(k)
                pool = g.pool()
                self.graphs[k] = (g, out)
                if len(self.graphs) % 8 == 0 or len(self.graphs) == len(self.keys):
                    log.info("egemma: captured %d/%d CUDA graphs", len(self.graphs), len(self.keys))
            torch.cuda.synchronize()
            self.capture_s = time.perf_counter() - t0
            log.info("egemma: %d CUDA graphs captured in %.1fs, GPU memory peak %.2f GiB", len(self.graphs),
                     self.capture_s, torch.cuda.max_memory_allocated(dev) / 2 ** 30)

    def slots(self, t: int) -> int:
        return min(self.e.ec.max_seqs, t)

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        t, m = key
        n = self.slots(t)
        b = Packed(self.meta[:t], self.meta[t:2 * t], self.meta[2 * t:2 * t + n + 2].int(), m)
        a = self.attn[key]
        x = self.e.model.forward(b, self.e.ops, (attention_fn(a[0]), attention_fn(a[1])))
        return self.e.model.pool(x, b.cu_seqlens, n, self.e.ops)

    def _fill(self, t: int, ids: np.ndarray, lengths: list[int]):
        n, B, T = self.slots(t), len(lengths), ids.size
        lens = np.asarray(lengths, dtype=np.int64)
        buf = self.staging.numpy()
        ids_, pos, cu = buf[:t], buf[t:2 * t], buf[2 * t:2 * t + n + 2]
        ids_[:T] = ids
        ids_[T:] = self.e.cfg.pad_id
        cu[0] = 0
        np.cumsum(lens, out=cu[1:B + 1])
        cu[B + 1:] = T
        cu[-1] = t  # the padding tokens [T, t) are one more sequence, which pooling skips (past the slots)
        pos[:T] = np.arange(T) - np.repeat(cu[:B], lens)
        pos[T:] = 0
        size = 2 * t + n + 2
        self.meta[:size].copy_(self.staging[:size], non_blocking=True)

    def _fill_dummy(self, key: tuple[int, int]):
        t, m = key
        lengths = [m] * (t // m)
        self._fill(t, np.random.default_rng(0).integers(4, self.e.cfg.vocab_size, sum(lengths)), lengths)

    def key(self, n_tokens: int, max_len: int) -> tuple[int, int]:
        t = next(t for t in self.buckets if t >= n_tokens)
        return t, min(next(m for m in self.classes if m >= max_len), t)

    def run(self, ids: np.ndarray, lengths: list[int], use_graph: bool = True) -> np.ndarray:
        k = self.key(ids.size, max(lengths))
        self._fill(k[0], ids, lengths)  # staging is free: the previous run's .cpu() waited for its copy
        if use_graph and k in self.graphs:
            g, out = self.graphs[k]
            g.replay()
            self.e.stats["graph_replays"] += 1
        else:
            out = self._forward(k)
            self.e.stats["eager_runs"] += 1
        return out[:len(lengths)].cpu().numpy()

    def _pick_attention(self, key: tuple[int, int], cands: list[str]) -> tuple[str, str]:
        """Fastest candidate for sliding and for global layers in this graph, timed on a full batch of it."""
        if len(cands) == 1:
            return cands[0], cands[0]
        c, dev, dt = self.e.cfg, self.e.device, self.e.model.dtype
        t, m = key
        self._fill_dummy(key)
        cu = self.meta[2 * t:2 * t + self.slots(t) + 2].int()
        # q / k / v exactly as the forward makes them (v stays a strided view of the qkv GEMM output):
        # timed on other layouts, the ranking came out differently than inside the graphs.
        qkv = torch.randn(t, (c.heads + 2 * c.kv_heads) * c.head_dim, device=dev, dtype=dt)
        L = self.e.model.layers[0]
        q, k, v = self.e.ops.qk_norm_rope(qkv, self.meta[t:2 * t], L.q_norm, L.k_norm, *self.e.model.rope[True],
                                          c.heads, c.kv_heads, c.eps)
        best = []
        for window in (c.window, -1):
            times = {}
            for name in cands:  # timed as graph replays: eager timing measures FA3's Python overhead instead
                f = attention_fn(name)
                f(q, k, v, cu, m, window, c.attn_scale)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(5):
                        f(q, k, v, cu, m, window, c.attn_scale)
                runs = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    g.replay()
                    end.record()
                    end.synchronize()
                    runs.append(start.elapsed_time(end))
                times[name] = sorted(runs)[2]
            best.append(min(times, key=times.get))
        return best[0], best[1]
