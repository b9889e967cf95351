"""Boot timeline of the launcher, cold then warm: `python -m egemma.ops.launcher` started with an empty --cache-dir,
stopped (SIGTERM), started again on the same cache directory, stopped. For each start it prints the wall time from
the launcher's process start to its `ready:` line, each model instance's phases from the `egemma boot:` lines of
the server log (egemma.engine.process: import, weights / tokenizer, kernels, capture, ready; when each started after
the launcher's start, and how long it took, with the weights' source: checkpoint or cache), and the stop that
followed (seconds from SIGTERM to exit, exit code, whether Triton waited out its exit timeout).

  python -m perf.serving.boot CHECKPOINT [--cache-dir DIR] [--runs cold,warm] [--out boot.json] [--timeout 240]
                      [-- LAUNCHER ARGS...]

The cache directory defaults to a new temporary one (removed after); a given one is emptied first for the cold
start. Launcher arguments after `--` (e.g. --instances embeddinggemma_encoder=1) go to every start."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from egemma.engine.process import PREFIX
from egemma.ops.repository import ROOT
from egemma.ops.tritonserver import free_port

LINE = re.compile(re.escape(PREFIX) + r" pid=(\d+) instance=(\S+) phase=(\w+) end=([\d.]+) seconds=([\d.]+)(.*)")
PHASES = ("import", "tokenizer", "weights", "kernels", "capture", "ready")
BAD = ("Exit timeout expired", "Non-graceful termination detected")


def start(ckpt: Path, cache: Path, run_dir: Path, extra: list[str], timeout: float, log_path: Path) -> dict:
    """One start and stop of the launcher: its timeline (see the module docstring). Its output goes to log_path as it
    comes, so a start that hangs past a device call's limit still shows where. The launcher is started here, not by
    perf/lib/servers.py: what is timed is its own output, line by line, and its stop."""
    ports = [free_port() for _ in range(3)]
    argv = [sys.executable, "-m", "egemma.ops.launcher", "--model", str(ckpt), "--cache-dir", str(cache),
            "--run-dir", str(run_dir), "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
            "--metrics-port", str(ports[2]), *extra]
    lines: list[tuple[float, str]] = []
    ended = threading.Event()  # the `ready:` line, or the launcher's output closed (it exited)
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read():
        with log_path.open("w") as live:
            for line in proc.stdout:
                lines.append((time.time(), line.rstrip("\n")))
                live.write(f"{time.time() - t0:8.2f} {line}")
                live.flush()
                if line.startswith("ready:"):
                    ended.set()
        ended.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ended.wait(timeout)
    ok = any(text.startswith("ready:") for _, text in lines)
    if not ok and proc.poll() is None:
        # every stub prints its threads' stacks (egemma.engine.process.begin) into the log before the stop
        subprocess.run(["pkill", "-USR1", "-f", "triton_python_backend_stub"], check=False)
        time.sleep(2)  # (not synchronisation: a margin for the stacks to reach the log)
    t_ready = time.time()
    t_stop = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
    stopped = time.time() - t_stop
    reader.join(10)
    log = "\n".join(text for _, text in lines)
    if not ok:
        raise SystemExit(f"the launcher was not ready (exit code {rc}, {time.time() - t0:.0f}s); its output:\n"
                         f"{log[-4000:]}")
    instances: dict[str, dict] = {}
    for m in LINE.finditer(log):
        pid, name, phase, end, seconds, info = m.groups()
        inst = instances.setdefault(name, {"pid": int(pid), "phases": {}})
        inst["phases"][phase] = {"start": float(end) - float(seconds) - t0, "seconds": float(seconds),
                                 **dict(kv.split("=", 1) for kv in info.split())}
    return {"ready_s": t_ready - t0, "instances": instances, "stop_s": stopped, "rc": rc,
            "bad_lines": [b for b in BAD if b in log], "log": log}


def table(name: str, r: dict):
    print(f"\n== {name}: process start to ready {r['ready_s']:.1f}s; stop {r['stop_s']:.1f}s rc {r['rc']}"
          f"{'; ' + ', '.join(r['bad_lines']) if r['bad_lines'] else ''}")
    print(f"{'instance':32s}" + "".join(f"{p:>18s}" for p in PHASES) + "   (start+seconds, from launcher start)")
    for inst, v in sorted(r["instances"].items(), key=lambda kv: min(p["start"] for p in kv[1]["phases"].values())):
        cells = []
        for p in PHASES:
            ph = v["phases"].get(p)
            cells.append(f"{ph['start']:7.1f}+{ph['seconds']:<6.2f}" if ph else "-")
        src = v["phases"].get("weights", {}).get("source")
        print(f"{inst:32s}" + "".join(f"{c:>18s}" for c in cells) + (f"   weights: {src}" if src else ""))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--cache-dir", type=Path, help="emptied first (default: a new temporary directory)")
    ap.add_argument("--runs", default="cold,warm", help="comma-separated: cold (cache emptied first) or warm")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds each start may take")
    ap.add_argument("--out", type=Path, default=Path("boot.json"),
                    help="the timelines as JSON, each start's log beside it, written as it comes (default boot.json)")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    tmp = Path(tempfile.mkdtemp(prefix="egemma-boot-"))
    cache = a.cache_dir or tmp / "cache"
    results = {}
    try:
        for i, run in enumerate(a.runs.split(",")):
            if run == "cold":
                shutil.rmtree(cache, ignore_errors=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            log = a.out.parent / f"{a.out.stem}-{i + 1}-{run}.log"
            r = start(a.checkpoint, cache, tmp / f"run{i}", extra, a.timeout, log)
            table(f"{run} (start {i + 1})", r)
            results[f"{i + 1}-{run}"] = r
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for r in results.values():
        r.pop("log")
    a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
