"""The floor repository for perf/serving/bench_serve.py --floor / --floor-wait: our model_repository (same configs,
instance counts and ensemble) with both Python models replaced by perf/serving/floor_model.py, which does nothing: what
Triton, the ensemble and the Python backend alone cost per request on a host."""
import shutil
from pathlib import Path

from egemma.ops.repository import ROOT

MODELS = ("embeddinggemma_tokenizer", "embeddinggemma_encoder")


def floor_repository(dest: Path, wait_us: int = 0) -> Path:
    """model_repository (same configs, instance counts, ensemble) with both Python models replaced by
    perf/serving/floor_model.py; wait_us: each encoder execute sleeps that long first."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ROOT / "model_repository", dest, ignore=shutil.ignore_patterns("__pycache__"))
    for model in MODELS:
        shutil.copy(ROOT / "perf" / "serving" / "floor_model.py", dest / model / "1" / "model.py")
    if wait_us:
        with open(dest / MODELS[1] / "config.pbtxt", "a") as f:
            f.write(f'parameters {{ key: "floor_wait_us" value: {{ string_value: "{wait_us}" }} }}\n')
    return dest
