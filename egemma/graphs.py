"""Whole-forward CUDA graphs (layers + pooling + Dense + normalise), one per token bucket, captured
largest-first into one memory pool. A batch replays the smallest bucket that holds its tokens: the padding
tokens form one extra sequence that pooling ignores, and unused sequence slots are empty (cu_seqlens
repeats). The attention backend of each bucket and layer type is picked by timing at load."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from egemma.model import Packed
from kernels.select import attention_fn

log = logging.getLogger("egemma")


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
        cfg, dev = e.cfg, e.device
        self.buckets = bucket_sizes(e.ec.max_tokens)
        T, S = self.buckets[-1], e.ec.max_seqs
        self.ids = torch.zeros(T, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(T, dtype=torch.int64, device=dev)
        self.seq_idx = torch.zeros(T, dtype=torch.int64, device=dev)
        self.cu = torch.zeros(S + 2, dtype=torch.int32, device=dev)
        self.lengths = torch.ones(S + 1, dtype=torch.float32, device=dev)
        cands = [b for b in e.attn_candidates if b != "native"]  # native attention syncs: not capturable
        self.capture = capture and bool(cands)
        self.attn = {t: self._pick_attention(t, cands) if cands else ("native", "native") for t in self.buckets}
        log.info("egemma: attention per bucket (sliding, global): %s",
                 ", ".join(f"{t}:{a[0]}/{a[1]}" for t, a in self.attn.items()))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.capture:
            t0 = time.perf_counter()
            pool = None
            for t in reversed(self.buckets):
                self._fill_dummy(t)
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    self._forward(t)  # warm-up: lazy inits and workspace allocations stay out of the graph
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._forward(t)
                pool = g.pool()
                self.graphs[t] = (g, out)
                log.info("egemma: captured CUDA graph for %d tokens (%d/%d)", t, len(self.graphs), len(self.buckets))
            torch.cuda.synchronize()
            self.capture_s = time.perf_counter() - t0
            log.info("egemma: %d CUDA graphs captured in %.1fs, GPU memory %.2f GiB", len(self.graphs),
                     self.capture_s, torch.cuda.max_memory_allocated(dev) / 2 ** 30)

    def slots(self, t: int) -> int:
        return min(self.e.ec.max_seqs, t)

    def _packed(self, t: int) -> Packed:
        n = self.slots(t)
        return Packed(self.ids[:t], self.pos[:t], self.cu[:n + 2], min(t, self.e.cfg.max_positions),
                      self.seq_idx[:t], self.lengths[:n])

    def _forward(self, t: int) -> torch.Tensor:
        b = self._packed(t)
        a = self.attn[t]
        x = self.e.model.forward(b, self.e.ops, (attention_fn(a[0]), attention_fn(a[1])))
        return self.e.model.pool(x, b.seq_idx, b.lengths)

    def _fill(self, t: int, ids: torch.Tensor, lengths: list[int]):
        n, B, T = self.slots(t), len(lengths), ids.numel()
        lens = np.asarray(lengths, dtype=np.int64)
        cu = np.full(n + 2, T, dtype=np.int32)
        cu[0] = 0
        np.cumsum(lens, out=cu[1:B + 1])
        cu[-1] = t  # the padding tokens [T, t) are one more sequence ...
        seq_idx = np.full(t, n, dtype=np.int64)  # ... whose tokens pooling skips (seq_idx >= slots)
        seq_idx[:T] = np.repeat(np.arange(B), lens)
        pos = np.zeros(t, dtype=np.int64)
        pos[:T] = np.arange(T) - np.repeat(cu[:B].astype(np.int64), lens)
        full_lens = np.ones(n, dtype=np.float32)
        full_lens[:B] = lens
        self.ids[:T].copy_(ids)
        self.ids[T:t].fill_(self.e.cfg.pad_id)
        self.pos[:t].copy_(torch.from_numpy(pos))
        self.seq_idx[:t].copy_(torch.from_numpy(seq_idx))
        self.cu[:n + 2].copy_(torch.from_numpy(cu))
        self.lengths[:n].copy_(torch.from_numpy(full_lens))

    def _fill_dummy(self, t: int):
        L = min(t, self.e.cfg.max_seq_length)
        lengths = [L] * (t // L)
        self._fill(t, torch.randint(4, self.e.cfg.vocab_size, (sum(lengths),)), lengths)

    def bucket(self, n_tokens: int) -> int:
        return next(t for t in self.buckets if t >= n_tokens)

    def run(self, ids: torch.Tensor, lengths: list[int], use_graph: bool = True) -> np.ndarray:
        t = self.bucket(ids.numel())
        self._fill(t, ids, lengths)
        if use_graph and t in self.graphs:
            g, out = self.graphs[t]
            g.replay()
            self.e.stats["graph_replays"] += 1
        else:
            out = self._forward(t)
            self.e.stats["eager_runs"] += 1
        return out[:len(lengths)].cpu().numpy()

    def _pick_attention(self, t: int, cands: list[str]) -> tuple[str, str]:
        """Fastest candidate for sliding and for global layers at this bucket, timed on a full bucket."""
        if len(cands) == 1:
            return cands[0], cands[0]
        c, dev, dt = self.e.cfg, self.e.device, self.e.model.dtype
        self._fill_dummy(t)
        b = self._packed(t)
        q = torch.randn(t, c.heads, c.head_dim, device=dev, dtype=dt)
        k = torch.randn(t, c.kv_heads, c.head_dim, device=dev, dtype=dt)
        v = torch.randn(t, c.kv_heads, c.head_dim, device=dev, dtype=dt)
        best = []
        for window in (c.window, -1):
            times = {}
            for name in cands:
                f = attention_fn(name)
                for _ in range(3):
                    f(q, k, v, b.cu_seqlens, b.max_seqlen, window, c.attn_scale)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    f(q, k, v, b.cu_seqlens, b.max_seqlen, window, c.attn_scale)
                end.record()
                end.synchronize()
                times[name] = start.elapsed_time(end) / 10
            best.append(min(times, key=times.get))
        return best[0], best[1]
