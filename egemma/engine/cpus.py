"""The CPU cores this process may use, as a Kubernetes pod sees them: what the tokenizer's thread pool and the
instance counts (egemma.ops.host) are sized by."""
from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity, capped by a cgroup v2 (cpu.max) or v1 CPU quota."""
    cores = len(os.sched_getaffinity(0))
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            fields = Path(quota_file).read_text().split()
            quota, period = fields[0], (fields[1] if period_file is None else Path(period_file).read_text().strip())
        except (OSError, IndexError):
            continue
        if quota not in ("max", "-1"):
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
        break
    return cores
