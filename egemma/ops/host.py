"""What this host gives the server, read without importing torch: the GPUs CUDA will number (after
CUDA_VISIBLE_DEVICES), and the instance counts that follow from them and from the CPU cores this process may use
(egemma.engine.process.usable_cores: affinity and cgroup quota, as in a Kubernetes pod)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from egemma.spec import ENCODER, TOKENIZER

# Tokenizer instances: one per 4 usable cores, at most 4 per GPU served, at least 1: past that an instance only
# adds a process, below it instances compete for the cores that tokenise (measured on one 16-core H200 host only:
# perf/RESULTS.md; deploy/README.md, "Every GPU of a host").
CORES_PER_TOKENIZER = 4
TOKENIZERS_PER_GPU = 4
# Encoder instances per GPU: each request costs its instance Python time and Triton's response path, so one instance
# caps the request rate; 3 is the latency/throughput balance and 4 the throughput setting (perf/RESULTS.md). The
# repository's config.pbtxt counts are these for a bare `tritonserver` run (tests/test_placement.py holds them
# equal); TritonServer renders these.
ENCODERS_PER_GPU = 3
# Without a GPU each encoder instance is a CPU forward competing for the cores.
CPU_INSTANCES = {ENCODER: 1, TOKENIZER: 2}


def physical_gpus() -> int:
    """NVIDIA GPUs this process can open: `nvidia-smi -L`, else /proc/driver/nvidia/gpus (inside a container the
    toolkit shows only the GPUs given to it); 0 without the driver."""
    if not os.path.exists("/dev/nvidiactl"):
        return 0
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
            n = sum(line.startswith("GPU ") for line in out.splitlines())
            if n:
                return n
        except (OSError, subprocess.TimeoutExpired):
            pass
    d = Path("/proc/driver/nvidia/gpus")
    return len(list(d.iterdir())) if d.is_dir() else 0


def cuda_numbered(physical: int, cuda_visible_devices: str | None) -> int:
    """How many devices CUDA numbers 0..n-1: all physical ones, or those CUDA_VISIBLE_DEVICES lists (indices or
    GPU-/MIG- UUIDs; CUDA stops at the first entry it cannot parse, and an empty value hides every GPU)."""
    if cuda_visible_devices is None:
        return physical
    n = 0
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not (entry.isdigit() and int(entry) < physical or entry.startswith(("GPU-", "MIG-"))):
            break
        n += 1
    return min(n, physical)


def visible_gpus() -> list[int]:
    """CUDA device ids of this host's GPUs as the server and its model processes will number them."""
    return list(range(cuda_numbered(physical_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))))


def parse_gpus(spec: str, visible: list[int]) -> list[int]:
    """--gpus: "all" (every visible GPU; none on a CPU host) or a comma-separated list of visible device ids."""
    if spec == "all":
        return list(visible)
    try:
        ids = [int(s) for s in spec.split(",")]
    except ValueError:
        raise ValueError(f"--gpus {spec!r}: expected 'all' or device ids such as 0,1") from None
    if len(set(ids)) != len(ids) or not set(ids) <= set(visible):
        raise ValueError(f"--gpus {spec!r}: not distinct ids among the visible GPUs {visible or '(none)'}")
    return ids


def tokenizer_instances(cores: int, gpus: int) -> int:
    """The tokenizer's instance count for a host with `cores` usable cores serving `gpus` GPUs (rule above)."""
    return max(1, min(cores // CORES_PER_TOKENIZER, TOKENIZERS_PER_GPU * max(gpus, 1)))


def default_instances(gpu_host: bool, cores: int, gpus: int) -> dict[str, int]:
    """The served models' instance counts: CPU_INSTANCES without a GPU, else ENCODERS_PER_GPU (per GPU: Triton's
    count for KIND_GPU) and the tokenizer's from the cores (tokenizer_instances)."""
    if not gpu_host:
        return dict(CPU_INSTANCES)
    return {ENCODER: ENCODERS_PER_GPU, TOKENIZER: tokenizer_instances(cores, gpus)}
