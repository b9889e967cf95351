"""Prometheus metrics of the Python-backend models and of the gateway: counters and histograms as float64 slots in
a shared memory map, written with plain stores (no system call, no round trip to the Triton process: pb_utils's
MetricFamily costs one per update, which slowed a single query) and read by another
process, which sums the maps of every writer and renders Prometheus text (`render`). The stubs write STUB_FAMILIES to
<$EGEMMA_HEARTBEAT_DIR>/<instance name>.stats, which the gateway's GET /metrics renders (egemma.gateway.metrics); the
gateway's workers use the same store for their own families. Label values are fixed when a family is declared: never
a request's text. What Triton counts itself (nv_inference_count, nv_inference_exec_count, ...) is not counted again,
nor what a histogram's _sum or _count already gives."""
from __future__ import annotations

import bisect
import itertools
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from egemma.stub.instance import heartbeat_dir


@dataclass(frozen=True)
class Family:
    """A counter (no buckets; name ends in _total) or a histogram (upper bounds, +Inf implied), with at most a few
    labels whose values are all given here."""
    name: str
    help: str
    buckets: tuple[float, ...] = ()
    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def width(self) -> int:
        """Slots per label combination: a counter's value; a histogram's bucket counts (+Inf last) and sum."""
        return len(self.buckets) + 2 if self.buckets else 1

    def combos(self) -> list[tuple[str, ...]]:
        return list(itertools.product(*self.labels.values()))


def layout(families: list[Family]) -> tuple[dict[str, int], int]:
    """({family name: first slot}, slots in all)."""
    starts, n = {}, 0
    for f in families:
        starts[f.name] = n
        n += f.width * len(f.combos())
    return starts, n


class Shared:
    """One writer's slots of `families` in a map (a file's, or an anonymous one shared with forked processes, at
    slot offset `at`). inc / observe are a few stores: for hot paths."""

    def __init__(self, families: list[Family], mm: mmap.mmap | None = None, at: int = 0):
        self.families = {f.name: f for f in families}
        self.starts, n = layout(families)
        self.mm = mm if mm is not None else mmap.mmap(-1, 8 * n)
        self.v = memoryview(self.mm).cast("d")[at:at + n]
        self.index = {f.name: {c: self.starts[f.name] + k * f.width for k, c in enumerate(f.combos())}
                      for f in families}

    @classmethod
    def in_file(cls, families: list[Family], path: Path) -> "Shared":
        """Slots in a new file at path (zeroed)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, 8 * max(1, layout(families)[1]))
            return cls(families, mmap.mmap(fd, 0))
        finally:
            os.close(fd)

    def inc(self, name: str, labels: tuple[str, ...] = (), n: float = 1.0):
        self.v[self.index[name][labels]] += n

    def observe(self, name: str, x: float, labels: tuple[str, ...] = ()):
        i, f = self.index[name][labels], self.families[name]
        self.v[i + bisect.bisect_left(f.buckets, x)] += 1  # le: the first bound >= x
        self.v[i + f.width - 1] += x


def instance_stats(name: str, families: list[Family]) -> Shared:
    """A model instance's Shared in the heartbeat directory (egemma.stub.instance), or in memory without one
    (tritonserver started by hand: written, read by nobody)."""
    d = heartbeat_dir()
    return Shared.in_file(families, Path(d) / f"{name}.stats") if d else Shared(families)


def read_stats(directory: str | Path, families: list[Family]) -> list[memoryview]:
    """The slots of every *.stats file in directory that has families' layout (a file of another layout is skipped)."""
    n, out = layout(families)[1], []
    for p in sorted(Path(directory).glob("*.stats")) if directory else ():
        try:
            raw = p.read_bytes()
        except OSError:
            continue
        if len(raw) == 8 * n:
            out.append(memoryview(raw).cast("d"))
    return out


def _labels(f: Family, combo: tuple[str, ...], le: str | None = None) -> str:
    pairs = [*zip(f.labels, combo), *([("le", le)] if le is not None else [])]
    return "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else ""


def _num(x: float) -> str:
    return repr(int(x)) if x == int(x) and abs(x) < 1 << 53 else repr(x)


def render(families: list[Family], writers: list) -> str:
    """Prometheus text of the sum over writers (each a sequence of a layout's slots). Unlabelled families always
    appear (zeros included), labelled ones only for combinations seen."""
    starts, n = layout(families)
    total = [0.0] * n
    for w in writers:
        for i in range(n):
            total[i] += w[i]
    out = []
    for f in families:
        kind = "histogram" if f.buckets else "counter"
        out += [f"# HELP {f.name} {f.help}", f"# TYPE {f.name} {kind}"]
        for k, combo in enumerate(f.combos()):
            s = total[starts[f.name] + k * f.width: starts[f.name] + (k + 1) * f.width]
            if f.labels and not any(s):
                continue
            if not f.buckets:
                out.append(f"{f.name}{_labels(f, combo)} {_num(s[0])}")
                continue
            cum = list(itertools.accumulate(s[:-1]))
            out += [f"{f.name}_bucket{_labels(f, combo, _num(b))} {_num(c)}" for b, c in zip(f.buckets, cum)]
            out += [f"{f.name}_bucket{_labels(f, combo, '+Inf')} {_num(cum[-1])}",
                    f"{f.name}_sum{_labels(f, combo)} {_num(s[-1])}",
                    f"{f.name}_count{_labels(f, combo)} {_num(cum[-1])}"]
    return "\n".join(out) + "\n"


_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
            120)
STUB_FAMILIES = [
    Family("egemma_batch_size", "Sequences in one encoder execute (Triton's dynamic batch, packed)",
           (1, 2, 4, 8, 16, 32, 64, 128, 256)),
    Family("egemma_batch_tokens", "Tokens in one encoder execute",
           (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)),
    Family("egemma_tokenize_duration_seconds", "Time of one tokenizer execute (its whole batch), seconds", _SECONDS),
    Family("egemma_engine_duration_seconds", "Time of the engine's embed in one encoder execute (the GPU's "
                                             "included), seconds", _SECONDS),
    Family("egemma_encoder_seconds_total", "Time in the encoder's execute (the engine's embed and its own parsing "
                                           "and responses), seconds"),
    Family("egemma_graph_replays_total", "Forwards replayed from a CUDA graph"),
    Family("egemma_eager_runs_total", "Forwards run eagerly"),
]
