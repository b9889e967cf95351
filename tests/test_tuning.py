"""The tuning file (egemma.engine.tuning): every load-time choice made once per setup and read by every other
instance and restart; N engines starting together tune once; a corrupt or foreign file is tuned again with a
warning; an unwritable cache directory tunes in memory with a warning. In-process engines, then a real server's
instances and its restart."""
import json
import logging
import os
import subprocess
import sys

import pytest

from helpers import ROOT

TUNED, READ = "tuning: tuned in", "tuning: read"


def engine(checkpoint, cache, caplog, **kw):
    from egemma.engine import Engine, EngineConfig
    os.environ["EGEMMA_CACHE_DIR"] = str(cache)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="egemma"):
        e = Engine(EngineConfig(str(checkpoint), **{"deterministic": True, **kw}))
    return e, caplog.text


@pytest.fixture(autouse=True)
def _restore_env():
    before = os.environ.get("EGEMMA_CACHE_DIR")
    yield
    if before is None:
        os.environ.pop("EGEMMA_CACHE_DIR", None)
    else:
        os.environ["EGEMMA_CACHE_DIR"] = before


def test_written_once_then_read(checkpoints, tmp_path, caplog):
    first, log1 = engine(checkpoints["eos"], tmp_path, caplog)
    files = list(tmp_path.glob("tuning-*.json"))
    assert TUNED in log1 and READ not in log1 and len(files) == 1, log1
    doc = json.loads(files[0].read_text())
    assert doc["key"]["settings"]["deterministic"] is True and doc["choices"]["mlp_up"]
    second, log2 = engine(checkpoints["eos"], tmp_path, caplog)
    assert READ in log2 and TUNED not in log2, log2
    assert second.choices == first.choices
    _, log3 = engine(checkpoints["eos"], tmp_path, caplog, deterministic=False)  # another setup: its own file
    assert TUNED in log3 and len(list(tmp_path.glob("tuning-*.json"))) == 2


@pytest.mark.parametrize("damage", ["corrupt", "foreign", "wrong-shape"])
def test_damaged_file_is_tuned_again_with_a_warning(checkpoints, tmp_path, caplog, damage):
    engine(checkpoints["eos"], tmp_path, caplog)
    f = next(tmp_path.glob("tuning-*.json"))
    doc = json.loads(f.read_text())
    if damage == "corrupt":
        f.write_text(f.read_text()[:40])
    elif damage == "foreign":
        doc["key"]["gpu"] = {"name": "NVIDIA B200"}
        doc["key"]["versions"]["torch"] = "torch==9.9"
        f.write_text(json.dumps(doc))
    else:
        doc["choices"] = {"norms": {}}
        f.write_text(json.dumps(doc))
    _, log = engine(checkpoints["eos"], tmp_path, caplog)
    assert TUNED in log and "tuning again" in log, log
    want = {"corrupt": "corrupt", "foreign": "another setup (differs in gpu, versions)", "wrong-shape": "corrupt"}
    assert want[damage] in log, log
    _, again = engine(checkpoints["eos"], tmp_path, caplog)  # the file was made whole again
    assert READ in again and "WARNING" not in again


def test_unwritable_cache_dir_tunes_in_memory_with_a_warning(checkpoints, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache directory under a file cannot be made, even by root (CI runs as root)
    e, log = engine(checkpoints["eos"], blocker / "cache", caplog)
    assert "not writable" in log and "tuning in memory" in log and TUNED in log, log
    assert e.embed([__import__("numpy").array([2, 7, 1], dtype="int32")]).shape == (1, e.cfg.out_dim)


def test_engines_starting_together_tune_once(checkpoints, tmp_path):
    """Three processes at once: the lock lets one tune, the others wait and read its file."""
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s');"
            "from egemma.engine import Engine, EngineConfig; Engine(EngineConfig(sys.argv[1], deterministic=True))")
    env = {**os.environ, "EGEMMA_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(checkpoints["eos"])], stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for _ in range(3)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert sum(TUNED in g for g in logs) == 1 and sum(READ in g for g in logs) == 2, logs


def test_server_instances_and_restart_share_one_tuning(start_server, tmp_path):
    """Two encoder instances of one server: one tunes, the other reads; the restarted server reads."""
    cache = tmp_path / "cache"
    os.environ["EGEMMA_CACHE_DIR"] = str(cache)
    logs = []
    for _ in range(2):
        s = start_server(instances={"embeddinggemma_encoder": 2}, params={"deterministic": "true"})
        s.stop()
        logs.append((s.run_dir / "tritonserver.log").read_text(errors="replace"))
    assert logs[0].count(TUNED) == 1 and logs[0].count(READ) == 1, logs[0]
    assert logs[1].count(TUNED) == 0 and logs[1].count(READ) == 2, logs[1]
    assert len(list(cache.glob("tuning-*.json"))) == 1
