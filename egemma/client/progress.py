"""egemma-embed's progress: a tqdm bar on a terminal (how far into the input, docs/s, tokens/s, ETA from the input's
size), a plain line every `interval` seconds otherwise (a job's log), nothing with --progress none."""
from __future__ import annotations

import collections
import os
import sys
import time

RATE_WINDOW = 30.0  # seconds of answers the ETA's rate is measured over


def si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


class Progress:
    def __init__(self, mode: str, total: int | None, unit: str, start: int, interval: float = 10.0):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode, self.total, self.unit, self.interval = mode, total, unit, interval
        self.t0 = self.last = time.monotonic()
        self.start = self.pos = start
        self.rows = self.tokens = self.bad = self.retries = 0
        self.bar = None
        self.seen: collections.deque = collections.deque()  # (time, pos) of the updates of the last RATE_WINDOW s
        if mode == "bar":
            from tqdm import tqdm
            # A terminal without a window size (a pty nobody sized: 0 x 0) makes tqdm draw nothing: a fixed size then
            size = os.get_terminal_size(sys.stderr.fileno())
            fixed = {} if size.columns and size.lines else {"ncols": 100, "nrows": 24}
            self.bar = tqdm(total=total, initial=start, unit=unit, unit_scale=True, dynamic_ncols=not fixed,
                            smoothing=0.1, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt}{unit} {elapsed}<{remaining}"
                                                      "{postfix}", file=sys.stderr, **fixed)

    def rates(self) -> tuple[float, float]:
        dt = max(time.monotonic() - self.t0, 1e-9)
        return self.rows / dt, self.tokens / dt

    def update(self, pos: int, rows: int, tokens: int, bad: int, retries: int):
        self.pos, self.rows, self.tokens, self.bad, self.retries = pos, self.rows + rows, self.tokens + tokens, \
            self.bad + bad, retries
        now = time.monotonic()
        self.seen.append((now, pos))
        while len(self.seen) > 2 and now - self.seen[1][0] >= RATE_WINDOW:
            self.seen.popleft()
        docs, toks = self.rates()
        line = f"{self.rows:,} docs, {docs:,.0f} docs/s, {si(toks)} tokens/s, {self.bad} bad, {retries} retries"
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)
            self.bar.update(pos - self.bar.n)
        elif self.mode == "log" and time.monotonic() - self.last >= self.interval:
            self.last = time.monotonic()
            print(f"egemma-embed: {self.where()}: {line}{self.eta()}", file=sys.stderr, flush=True)

    def where(self) -> str:
        if not self.total:
            return f"{si(self.pos)}{self.unit} read"
        return f"{100 * self.pos / self.total:.1f}% of {si(self.total)}{self.unit}"

    def eta(self) -> str:
        """From the rate of the last RATE_WINDOW seconds of answers, not from the start: the probe, the connections
        and the server's first batches are no measure of the rest."""
        if not self.total or len(self.seen) < 2:
            return ""
        (t0, p0), (t1, p1) = self.seen[0], self.seen[-1]
        if p1 <= p0 or t1 <= t0:
            return ""
        left = (self.total - self.pos) * (t1 - t0) / (p1 - p0)
        return f", ETA {left // 60:.0f} min {left % 60:02.0f} s"

    def note(self, msg: str):
        """A message that does not tear the bar."""
        if self.bar is not None:
            self.bar.write(f"egemma-embed: {msg}", file=sys.stderr)
        else:
            print(f"egemma-embed: {msg}", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
