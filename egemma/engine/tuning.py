"""Every load-time choice of the engine, made once per deployment and kept in a tuning file that every encoder
instance and every restart reads: the elementwise ops' backends, mlp_up's path per token bucket, attention's backend
per CUDA graph and layer type, the layer stack as one kernel per graph, and the settings around them (the cuBLAS
workspace, the clock warm-up before timing). One log line says what was chosen and whether it was read or timed.

Deterministic (EngineConfig.deterministic, off by default): one choice per op for every bucket and graph, the row
kernels at one launch shape, no layer stack, so a sequence's embedding has the same bits whatever it is batched with:
each kernel left computes a row from that row alone, in an order that does not depend on the batch.

The file: <cache dir>/tuning-<hash>.json, the hash of a key naming the GPU, driver, library versions, model shape and
engine settings; the key is stored inside and checked. Instances starting together tune once: the first takes an
flock, the others wait for it and read. A corrupt or foreign file is tuned again with a warning; a directory that
cannot be written means tuning in memory (a file already there is still read), with a warning."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from egemma.engine import select


log = logging.getLogger("egemma")
SCHEMA = 1
STACK_TOKENS = 16  # graphs offered the layer stack: it won at 16 tokens, lost by half at 32
# the modules whose kernels are timed, and the distributions that may install each
MODULES = {"torch": ("torch",), "triton": ("triton",), "flash_attn_interface": ("tokenspeed-fa3", "flash-attn-3"),
           "sgl_kernel": ("sglang-kernel", "sgl-kernel")}


@dataclass
class Choices:
    norms: dict[str, str]  # {"norm_add_norm": backend, "gelu_tanh_and_mul": backend}
    mlp_up: list[str]  # a path per token bucket (select.UNFUSED or a fused tile), one for all when deterministic
    attention: dict[str, list[str]] = field(default_factory=dict)  # "tokens/max_seqlen" -> [sliding, global]
    stack: list[str] = field(default_factory=list)  # graphs ("tokens/max_seqlen") run as the layer stack
    seconds: float = 0.0  # how long the timing took

    def summary(self) -> str:
        ops = ",".join(f"{k}={v}" for k, v in self.norms.items())
        runs = [n for i, n in enumerate(self.mlp_up) if i == 0 or n != self.mlp_up[i - 1]]
        attn = sorted({"/".join(v) for v in self.attention.values()})
        return (f"{ops}, mlp_up={'|'.join(runs)}, attention(sliding/global)={'|'.join(attn) or 'native'}, "
                f"layer stack on {len(self.stack)} graphs")


CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"


def gpu_settings(device: torch.device, cuda_graphs: bool):
    """Before the process's first cuBLAS call. No cuBLAS workspace: its Hopper GEMMs then take their static-schedule
    variants, which need no memset before each launch (in a CUDA graph each memset idled the GPU before its GEMM) and
    never split K by the batch's size. Eager calls pay for it on the host, hence graphs only. A
    value set before stands."""
    if device.type == "cuda" and cuda_graphs:
        os.environ.setdefault(CUBLAS_ENV, ":0:0")


def cublas_workspace() -> str | None:
    """The cuBLAS workspace this process runs with (gpu_settings' or the user's), for the boot log."""
    return os.environ.get(CUBLAS_ENV)


def _version(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    for d in MODULES[module]:
        try:
            return f"{d}=={importlib.metadata.version(d)}"
        except importlib.metadata.PackageNotFoundError:
            pass
    st = os.stat(spec.origin)  # unpacked without metadata: its file stands for its version
    return f"{spec.origin}:{st.st_size}:{int(st.st_mtime)}"


def fingerprint(device: torch.device, **settings) -> dict:
    """What the choices depend on: the GPU, its driver, the libraries' versions, and the model shape and engine
    settings given (JSON values)."""
    fp = {"schema": SCHEMA, "device": device.type, "settings": settings,
          "versions": {m: _version(m) for m in MODULES}}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        fp["gpu"] = {"name": p.name, "capability": [p.major, p.minor], "sms": p.multi_processor_count,
                     "driver": _driver(), "cuda": torch.version.cuda}
    return fp


def _driver() -> str | None:
    """The NVIDIA kernel driver's version line (Linux), which the GPU's kernels' timing also depends on."""
    try:
        return Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        return None


def _read(path: Path, fp: dict) -> tuple[Choices | None, str | None]:
    """(choices, None), or (None, why the file cannot be used; None where there is none)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"is unreadable or corrupt ({e})"
    if not isinstance(doc, dict) or doc.get("key") != fp:
        theirs = doc.get("key") if isinstance(doc, dict) and isinstance(doc.get("key"), dict) else {}
        differ = sorted(k for k in fp.keys() | theirs.keys() if fp.get(k) != theirs.get(k))
        return None, f"was made for another setup (differs in {', '.join(differ) or 'its form'})"
    try:
        return Choices(**doc["choices"]), None
    except (KeyError, TypeError) as e:
        return None, f"is corrupt ({e!r})"


def _write(path: Path, fp: dict, c: Choices):
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"key": fp, "choices": dataclasses.asdict(c)}, indent=1))
    os.replace(tmp, path)  # readers see the old file or the whole new one


def settle(fp: dict, directory: Path, tune: Callable[[], Choices]) -> Choices:
    """The choices for fp: read from the tuning file under directory, else tune() and save them there."""
    path = directory / f"tuning-{hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as e:
        c, why = _read(path, fp)
        if c is not None:
            log.warning("egemma: tuning: read %s (cache directory not writable: %s)", path, e)
            return c
        log.warning("egemma: tuning: cache directory %s is not writable (%s): tuning in memory, not shared with "
                    "other instances or restarts%s", directory, e, f"; {path} {why}" if why else "")
        return _tuned(tune, "kept in memory")
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first instance tunes; the others wait here, then read
        c, why = _read(path, fp)
        if c is not None:
            log.info("egemma: tuning: read %s", path)
            return c
        if why:
            log.warning("egemma: tuning file %s %s: tuning again", path, why)
        try:
            c = tune()
            _write(path, fp, c)
        except OSError as e:
            log.warning("egemma: tuning: could not save %s (%s): kept in memory", path, e)
            return c
        log.info("egemma: tuning: tuned in %.1fs, saved %s", c.seconds, path)
        return c


def _tuned(tune: Callable[[], Choices], where: str) -> Choices:
    c = tune()
    log.info("egemma: tuning: tuned in %.1fs, %s", c.seconds, where)
    return c


def warm_clocks(device: torch.device):
    """Kernels are chosen by timing: bring the GPU's clocks up first."""
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(200):
        x @ x
    torch.cuda.synchronize(device)


def _norms(backend, device, dtype, hidden, intermediate, tokens) -> dict[str, str]:
    """Each elementwise op's backend: the one asked for (sgl-kernel has no gelu_tanh_and_mul for the interleaved
    gate_up: Triton-lang's), else the fastest available on [tokens, hidden] data."""
    have = select.available_norm_backends(device)
    if backend != "auto" or len(have) == 1:
        b = have[0] if backend == "auto" else backend
        if b not in have:
            raise RuntimeError(f"norm backend {b!r} is not available on {device} (available: {have})")
        return {"norm_add_norm": b, "gelu_tanh_and_mul": "triton" if b == "sgl-kernel" else b}
    x, h = (torch.randn(tokens, hidden, device=device, dtype=dtype) for _ in range(2))
    w = torch.randn(hidden, device=device, dtype=dtype)
    gu = torch.randn(tokens, 2 * intermediate, device=device, dtype=dtype)
    args = {"norm_add_norm": (x, h, w, w, 1e-6), "gelu_tanh_and_mul": (gu,)}
    cands = {b: select._backend_ops(b) for b in have}
    out = {}
    for op, a in args.items():
        times = {b: select.time_ms(cands[b][op], *a) for b in have if op in cands[b]}
        out[op] = min(times, key=times.get)
    return out


def best(times: list[dict[str, float]], deterministic: bool,
         families: list[list[str]] | None = None) -> list[str]:
    """The fastest candidate at each size. Deterministic: only within one family of candidates that compute the same
    bits (default: each alone), the family fastest over all sizes together (the least mean time of its fastest
    relative to each size's fastest)."""
    if not deterministic:
        return [min(t, key=t.get) for t in times]
    fams = [f for f in (families or [[c] for c in sorted(set.intersection(*(set(t) for t in times)))])
            if all(set(f) & set(t) for t in times)]
    pick = min(fams, key=lambda f: sum(min(t[c] for c in f if c in t) / min(t.values()) for t in times))
    return [min((c for c in pick if c in t), key=t.get) for t in times]


def families(outputs: dict[str, torch.Tensor]) -> list[list[str]]:
    """Candidates grouped by the bits they compute on one probe: those with equal bits sum in the same order (a
    fused tile's K steps do not depend on its M and N blocks), so a deterministic engine may mix them."""
    out: list[list[str]] = []
    for name, y in outputs.items():
        fam = next((f for f in out if torch.equal(outputs[f[0]], y)), None)
        fam.append(name) if fam is not None else out.append([name])
    return out


def _mlp_up(norms, device, dtype, hidden, intermediate, buckets, layers, deterministic) -> list[str]:
    """mlp_up's path per token bucket, each timed over `layers` different weights (select.time_layers: one set would
    sit in L2 and flatter small sizes)."""
    cands = select.mlp_up_candidates(device, dtype, hidden, intermediate)
    if len(cands) == 1 or not buckets:
        return [cands[0]] * max(1, len(buckets))
    from triton.runtime.errors import OutOfResources
    ws = [torch.randn(2 * intermediate, hidden, device=device, dtype=dtype) / hidden ** 0.5 for _ in range(layers)]
    w_post = torch.randn(hidden, device=device, dtype=dtype) * 0.1
    fns = {n: select.build_ops(norms, [n], device, dtype, hidden, deterministic=deterministic).mlp_up
           for n in cands}
    x = torch.randn(buckets[0], hidden, device=device, dtype=dtype)
    select.compile_together([lambda f=f: f(x.clone(), x.clone(), w_post, ws[0], 1e-6) for f in fns.values()],
                            device)
    times, probe = [], {}
    for t in buckets:
        x = torch.randn(t, hidden, device=device, dtype=dtype)
        residual = torch.randn(t, hidden, device=device, dtype=dtype) * 10
        at = {}
        for name, f in fns.items():
            try:
                at[name] = select.time_layers(lambda i, f=f: f(x, residual, w_post, ws[i], 1e-6), layers)
            except OutOfResources as e:  # a tile too large for this GPU's shared memory: not a candidate here
                log.info("egemma: mlp_up tile %s does not fit %s: %s", name, device, e)
        times.append(at)
    if deterministic:  # which candidates compute the same bits: one probe batch through each that ran
        x = torch.randn(300, hidden, device=device, dtype=dtype)
        residual = torch.randn(300, hidden, device=device, dtype=dtype) * 10
        probe = {n: f(x.clone(), residual.clone(), w_post, ws[0], 1e-6) for n, f in fns.items()
                 if all(n in t for t in times)}
    return best(times, deterministic, families(probe) if probe else None)


def tune(model, runner, buckets: list[int], attention: list[str], tokens: int, norm_backend: str,
         deterministic: bool) -> Choices:
    """Time every choice for this model (egemma.engine.model.Encoder) on this device: attention among the candidates
    given, the elementwise ops' backend as norm_backend says (auto: timed). runner: its
    egemma.engine.graphs.GraphRunner (None on CPU), whose graphs' attention and layer stack are timed as captured."""
    t0 = time.perf_counter()
    c, dev, dtype = model.cfg, model.device, model.dtype
    if dev.type == "cuda":
        warm_clocks(dev)
    norms = _norms(norm_backend, dev, dtype, c.hidden, c.intermediate, tokens)
    t1 = time.perf_counter()
    mlp = _mlp_up(norms, dev, dtype, c.hidden, c.intermediate, buckets, c.layers, deterministic)
    t2 = time.perf_counter()
    choices = Choices(norms, mlp)
    cands = [b for b in attention if b != "native"]  # native attention syncs: not capturable
    if runner is not None and cands:
        ops = select.build_ops(norms, mlp, dev, dtype, c.hidden, buckets, deterministic)
        keys = runner.keys
        if len(cands) == 1:
            picks = [[cands[0]] * len(keys)] * 2
        else:
            picks = [best([runner.attention_ms(k, ops, cands, sliding) for k in keys], deterministic)
                     for sliding in (True, False)]
        choices.attention = {runner.name(k): [picks[0][i], picks[1][i]] for i, k in enumerate(keys)}
        if not deterministic:  # the layer stack sums in another order than the layered forward: never deterministic
            for k in keys:
                pair = tuple(choices.attention[runner.name(k)])
                if k[0] <= STACK_TOKENS and runner.stack_supported(k):
                    ms = {s: runner.forward_ms(k, ops, pair, s) for s in (False, True)}
                    log.info("egemma: %d tokens: the layer stack as one kernel %.3f ms, layered %.3f ms a forward",
                             k[0], ms[True], ms[False])
                    if ms[True] < ms[False]:
                        choices.stack.append(runner.name(k))
    choices.seconds = round(time.perf_counter() - t0, 2)
    log.info("egemma: tuning: clocks and norms %.1fs, mlp_up %.1fs, attention and layer stack %.1fs", t1 - t0,
             t2 - t1, t0 + choices.seconds - t2)
    return choices
