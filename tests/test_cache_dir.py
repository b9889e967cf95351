"""The cache directory's contents, each reused when sound and rebuilt with a warning when not: the fused weights
(egemma.engine.weights), the resolved tokenizer (egemma.engine.tokenizer), Triton-lang's kernels (sealed and checked
by egemma.ops.cachedir); an unwritable cache directory serves without caching. Then the launcher itself, cold and
warm, through perf/serving/boot.py: every instance's boot phases logged, the second start on the cached paths."""
import json
import logging
import subprocess
import sys

import torch

from egemma.engine import weights
from egemma.engine.process import ENV
from egemma.engine.config import ModelConfig
from egemma.engine.tokenizer import cached_tokenizer_json, resolve_ahead, resolved_tokenizer_json
from egemma.ops import cachedir
from helpers import ROOT


def _load(cfg, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="egemma"):
        g, stacked = weights.load(cfg, "cpu", torch.float32)
    source = next(r.getMessage().split("source=", 1)[1] for r in caplog.records if "phase=weights" in r.getMessage())
    return {**g, **stacked}, source


def test_fused_weights_are_cached_reused_and_rebuilt_when_corrupt(checkpoints, tmp_path, monkeypatch, caplog):
    cfg = ModelConfig.load(checkpoints["eos"])
    monkeypatch.delenv(ENV, raising=False)
    want, source = _load(cfg, caplog)
    assert source == "checkpoint"
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    first, source = _load(cfg, caplog)
    assert source == "checkpoint-cached"
    (path,) = (tmp_path / "cache" / "weights").glob("*.safetensors")
    second, source = _load(cfg, caplog)
    assert source == "cache"
    for got in (first, second):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    again, source = _load(cfg, caplog)
    assert source == "checkpoint-cached" and "unreadable" in caplog.text and "rebuilding" in caplog.text
    assert all(torch.equal(again[k], want[k]) for k in want)
    assert _load(cfg, caplog)[1] == "cache"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(ENV, str(blocker))
    got, source = _load(cfg, caplog)
    assert source == "checkpoint" and "cannot be written" in caplog.text
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_resolved_tokenizer_is_cached_and_resolved_again_when_corrupt(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path))
    want = resolved_tokenizer_json(checkpoints["eos"])
    assert cached_tokenizer_json(checkpoints["eos"]) == want
    (hit,) = (tmp_path / "tokenizer").glob("*.json")
    hit.write_text("{ not json")
    assert cached_tokenizer_json(checkpoints["eos"]) == want and hit.read_text() == want


def test_a_miss_resolved_ahead_serves_a_process_that_cannot_import_transformers(checkpoints, tmp_path, monkeypatch):
    """The launcher resolves a cold tokenizer (resolve_ahead) while the tokenizer model's stubs start; a stub whose
    environment cannot import transformers (the GPU host's numpy-1.26 stub env: perf/RESULTS.md run 126) waits for
    the entry instead of resolving it. The child starts after the lock is taken, so it always waits."""
    monkeypatch.setenv(ENV, str(tmp_path))
    ckpt = checkpoints["eos"]
    thread = resolve_ahead(ckpt)
    child = subprocess.run([sys.executable, "-c", (
        "import sys; sys.modules['transformers'] = None\n"  # any `import transformers` now fails
        "from egemma.engine.tokenizer import cached_tokenizer_json\n"
        f"sys.stdout.write(cached_tokenizer_json({str(ckpt)!r}))")], capture_output=True, text=True, cwd=ROOT)
    thread.join()
    assert child.returncode == 0, child.stderr
    assert child.stdout == resolved_tokenizer_json(ckpt)
    assert resolve_ahead(ckpt) is None  # a hit: nothing to do


def test_kernel_cache_entries_that_differ_from_the_sealed_copy_are_removed(tmp_path, monkeypatch):
    for var in (ENV, "TRITON_CACHE_DIR"):  # prepare() exports both; restored after the test
        monkeypatch.setenv(var, "unset")
    d, logs = tmp_path / "cache", []
    for h in ("aaa", "bbb", "ccc"):
        e = d / "triton" / h
        e.mkdir(parents=True)
        (e / "k.cubin").write_bytes(b"\x7fELF" + h.encode() * 100)
        (e / "__grp__k.json").write_text(json.dumps({"child_paths": {"k.cubin": str(e / "k.cubin")}}))
    cachedir.seal(d)
    (d / "triton" / "aaa" / "k.cubin").write_bytes(b"\x7fELF truncated")
    (d / "triton" / "bbb" / "__grp__k.json").write_text("{")
    env = cachedir.prepare(d, tmp_path / "run", log=logs.append)
    assert env["TRITON_CACHE_DIR"] == str(d / "triton") and env[ENV] == str(d)
    assert sorted(p.name for p in (d / "triton").iterdir()) == ["ccc"]
    assert len(logs) == 2 and all("corrupt" in m and "compiled again" in m for m in logs), logs
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = cachedir.prepare(blocker, tmp_path / "run", log=logs.append)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "run" / "triton-cache") and "serving without caching" in logs[-1]


def test_boot_cold_then_warm_logs_every_phase_and_takes_the_cached_paths(checkpoints, tmp_path):
    """perf/serving/boot.py drives the launcher twice on one cache directory: each start logs import, tokenizer /
    weights, kernels, capture and ready for every instance, the first builds the caches, the second reads them; both
    stops are clean."""
    out = tmp_path / "boot.json"
    r = subprocess.run([sys.executable, "-m", "perf.serving.boot", str(checkpoints["eos"]), "--out", str(out),
                        "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(r.stdout)
    runs = json.loads(out.read_text())
    assert list(runs) == ["1-cold", "2-warm"]
    for name, run in runs.items():
        assert run["rc"] == 0 and not run["bad_lines"], (name, run["rc"], run["bad_lines"])
        kinds = {}
        for inst, v in run["instances"].items():
            kinds.setdefault("encoder" if "encoder" in inst else "tokenizer", []).append(list(v["phases"]))
        assert kinds["tokenizer"] and all(p == ["import", "tokenizer", "ready"] for p in kinds["tokenizer"]), kinds
        assert kinds["encoder"] and all(p == ["import", "weights", "kernels", "capture", "ready"]
                                        for p in kinds["encoder"]), kinds
    sources = [{v["phases"]["weights"]["source"] for i, v in run["instances"].items() if "encoder" in i}
               for run in runs.values()]
    assert sources == [{"checkpoint-cached"}, {"cache"}], sources
    # cold, the launcher resolves the tokenizer into the cache while the models load and the tokenizer model reads it
    # there; warm, the launcher copies the cache's entry to the file the model reads
    sources = [{v["phases"]["tokenizer"]["source"] for i, v in run["instances"].items() if "tokenizer" in i}
               for run in runs.values()]
    assert sources == [{"cache"}, {"file"}], sources
    assert list((tmp_path / "cache" / "tokenizer").glob("*.json")) and (tmp_path / "cache" / "triton").is_dir()
