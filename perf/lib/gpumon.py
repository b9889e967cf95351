"""What the host's CPU and GPU do during a benchmark window: all cores' busy time (psutil), and nvidia-smi sampling
the GPU's utilisation, SM clock and power into a file while open."""
import statistics
import subprocess
from pathlib import Path

import psutil


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of all cores so far."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0), sum(t)  # idle and iowait are not busy


class GpuMonitor:
    """nvidia-smi sampling the GPU's utilisation (%), SM clock (MHz) and board power (W) every 200 ms while open into
    path; `means` after ({} without nvidia-smi). Back to back the 8 x 2048 forward holds the H200 at its power cap
    (perf/RESULTS.md, Engine): the clock says whether a workload ran there."""
    FIELDS = ("utilization.gpu", "clocks.sm", "power.draw")

    def __init__(self, path: Path):
        self.path, self.proc, self.means = path, None, {}

    def __enter__(self) -> "GpuMonitor":
        with open(self.path, "w") as log:  # the child keeps its own descriptor
            try:
                self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}",
                                              "--format=csv,noheader,nounits", "-lms", "200"],
                                             stdout=log, stderr=subprocess.DEVNULL)
            except OSError:
                pass
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        self.proc.terminate()
        self.proc.wait()
        rows = []
        for line in open(self.path).read().splitlines():
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:  # [N/A] where the GPU does not report one
                continue
        rows = [r for r in rows if len(r) == len(self.FIELDS)]
        if rows:
            self.means = {f: statistics.mean(r[i] for r in rows) for i, f in enumerate(self.FIELDS)}
