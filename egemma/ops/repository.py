"""The model repository as served: the checkpoint resolved (--model, $EMBEDDINGGEMMA_PATH, the hub, or a loud
random demo), and model_repository/ rendered into a run directory with parameters and instance counts written
into its configs (the source tree is never modified)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"
DEMO = ROOT / ".cache" / "demo-checkpoint"


def resolve_checkpoint(model: str | None) -> Path:
    """--model, else $EMBEDDINGGEMMA_PATH, else google/embeddinggemma-300m from the HF cache/hub, else (loudly)
    a generated demo checkpoint with random weights so the server always comes up."""
    for cand in (model, os.environ.get("EMBEDDINGGEMMA_PATH")):
        if cand:
            if not Path(cand).expanduser().is_dir():
                raise SystemExit(f"checkpoint directory {cand} does not exist")
            return Path(cand).expanduser().resolve()
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download("google/embeddinggemma-300m"))
    except Exception as e:  # offline, gated, not logged in: all end in the demo checkpoint
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"\n*** WARNING: google/embeddinggemma-300m is not available ({why}).\n"
          f"*** Serving a DEMO checkpoint with RANDOM weights from {DEMO}; its embeddings mean nothing.\n"
          "*** Pass --model DIR or set EMBEDDINGGEMMA_PATH for real embeddings.\n", file=sys.stderr)
    if not (DEMO / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), str(DEMO)], check=True,
                       stdout=subprocess.DEVNULL)
    return DEMO


def render_repository(dest: Path, checkpoint: Path, params: dict[str, str] | None = None, src: Path = REPO,
                      optional=(), instances: dict[str, int] | None = None) -> Path:
    """Copy a model repository to dest with the checkpoint, and any other parameters, written into every model
    config that declares them, and with `instances` ({model: count}) replacing those models' instance counts.
    A parameter no config declares, or a model not in the repository, is an error (parameters in optional
    excepted)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    params = {"checkpoint": str(checkpoint), **(params or {})}
    for model, count in (instances or {}).items():
        cfg = dest / model / "config.pbtxt"
        if not cfg.exists() or count < 1:
            raise ValueError(f"cannot give model {model!r} {count} instances (models: "
                             f"{sorted(c.parent.name for c in dest.glob('*/config.pbtxt'))})")
        text, n = re.subn(r"(instance_group \[ \{ count: )\d+", rf"\g<1>{count}", cfg.read_text())
        if n != 1:
            raise ValueError(f"{cfg}: no single 'instance_group [ {{ count: N' to set")
        cfg.write_text(text)
    used = set()
    for cfg in sorted(dest.glob("*/config.pbtxt")):
        text = cfg.read_text()
        for key, value in params.items():
            pat = re.compile(r'(parameters \{ key: "%s" value: \{ string_value: )"[^"]*"' % re.escape(key))
            if pat.search(text):
                text = pat.sub(lambda m: m.group(1) + '"%s"' % value, text)
                used.add(key)
        cfg.write_text(text)
    if set(params) - used - set(optional):
        raise ValueError(f"no model in {src} takes parameters {sorted(set(params) - used - set(optional))}")
    return dest
