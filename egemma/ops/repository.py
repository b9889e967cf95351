"""The model repository as served: the checkpoint resolved (--model as a directory or a Hugging Face hub id,
$EMBEDDINGGEMMA_PATH, the hub, or a loud random demo), and model_repository/ rendered into a run directory with
parameters, instance counts and GPU placement written into its configs (the source tree is never modified)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from egemma.engine.config import DEMO_MARKER
from egemma.spec import ENCODER, HUB_ID, PATH_ENV
from egemma.stub.adapter import env_path

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "model_repository"
DEMO = ROOT / ".cache" / "demo-checkpoint"
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# instance_group [ { count: N kind: KIND_X } ] or, placed, [ { count: N kind: KIND_GPU gpus: [ 0, 1 ] } ]
INSTANCE_GROUP = re.compile(r"instance_group \[ \{ count: (\d+) kind: (KIND_\w+)(?: gpus: \[ ([\d, ]*) \])? \} \]")


def hub_token_given() -> bool:
    """Whether the user gave a hub token: $HF_TOKEN, or $HF_TOKEN_PATH naming a file (a mounted secret)."""
    path = os.environ.get("HF_TOKEN_PATH")
    return bool(os.environ.get("HF_TOKEN")) or bool(path and Path(path).is_file())


def hub_snapshot(model_id: str) -> Path:
    """The hub checkpoint (HF cache, else downloaded; $HF_TOKEN or the file $HF_TOKEN_PATH authenticates). Any
    failure is a SystemExit that says what to do: the caller asked for these weights, so there is no fallback."""
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(model_id))
    except Exception as e:
        chain, c = [], e  # the hub's HTTP error may come wrapped (e.g. in LocalEntryNotFoundError)
        while c is not None and len(chain) < 5:
            chain.append(c)
            c = c.__cause__ or c.__context__
        status = next((s for c in chain if (s := getattr(getattr(c, "response", None), "status_code", None))), None)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if status in (401, 403) or any(type(c).__name__ == "GatedRepoError" for c in chain):
            token = "the token given was refused" if hub_token_given() else "neither HF_TOKEN nor HF_TOKEN_PATH is set"
            raise SystemExit(
                f"Hugging Face hub refused {model_id} (HTTP {status}, {type(e).__name__}): the model is gated. "
                f"Accept its license at https://huggingface.co/{model_id} with your account, then set HF_TOKEN "
                f"(or HF_TOKEN_PATH to a file holding it) to a token of that account with read access ({token}); "
                "or mount the weights and pass --model DIR. Not falling back to the random demo checkpoint.") from None
        raise SystemExit(f"cannot get {model_id} from the Hugging Face hub ({type(e).__name__}: {first}); pass "
                         "--model DIR for weights on disk. Not falling back to the random demo checkpoint.") from None


def resolve_checkpoint(model: str | None) -> Path:
    """--model, else $EMBEDDINGGEMMA_PATH: a checkpoint directory, or a hub id such as google/embeddinggemma-300m
    (a hub error is then fatal). Neither given: google/embeddinggemma-300m from the HF cache/hub, fatal too when
    a hub token is given (the user meant the hub), else on failure (loudly) a generated demo checkpoint with
    random weights so the server always comes up."""
    for cand in (model, env_path("checkpoint")):
        if cand:
            if Path(cand).expanduser().is_dir():
                return Path(cand).expanduser().resolve()
            if HUB_NAME.match(cand):
                return hub_snapshot(cand)
            raise SystemExit(f"checkpoint directory {cand} does not exist (nor is it a hub id such as {HUB_ID})")
    if hub_token_given():
        return hub_snapshot(HUB_ID)
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(HUB_ID))
    except Exception as e:  # offline, gated, not logged in: all end in the demo checkpoint
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"\n*** WARNING: {HUB_ID} is not available ({why}).\n"
          f"*** Serving a DEMO checkpoint with RANDOM weights from {DEMO}; its embeddings mean nothing.\n"
          f"*** {GET_REAL}\n", file=sys.stderr)
    return demo_checkpoint()


GET_REAL = (f"For real embeddings: `huggingface-cli download {HUB_ID}` (a gated model: accept its license on "
            f"https://huggingface.co/{HUB_ID} and `huggingface-cli login` or set HF_TOKEN first), or pass --model "
            "DIR (or set EMBEDDINGGEMMA_PATH=DIR) for a local copy.")


def demo_marker() -> dict:
    """What scripts/make_checkpoint.py writes into DEMO_MARKER; its version changes with the demo's shapes, so that
    an older generated demo is made again."""
    return {"demo": True, "weights": "random", "made_by": "scripts/make_checkpoint.py", "version": 2,
            "note": "its embeddings mean nothing; " + GET_REAL}


def demo_checkpoint() -> Path:
    """The generated demo checkpoint (DEMO), made when absent or older than this version of the generator."""
    try:
        current = json.loads((DEMO / DEMO_MARKER).read_text()) == demo_marker()
    except (OSError, ValueError):
        current = False
    if not current or not (DEMO / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), str(DEMO)], check=True,
                       stdout=subprocess.DEVNULL)
    return DEMO


def instance_group(count: int, kind: str, gpus: list[int] | None = None) -> str:
    placed = f" gpus: [ {', '.join(map(str, gpus))} ]" if gpus else ""
    return f"instance_group [ {{ count: {count} kind: {kind}{placed} }} ]"


def path_env(checkpoint: Path, run_dir: Path) -> dict[str, str]:
    """The paths the models (and the gateway) read, as environment variables (egemma.spec.PATH_ENV): the
    checkpoint and the tokenizer file the server writes into run_dir. Kept out of the rendered configs, which
    Triton serves to any client."""
    return {PATH_ENV["checkpoint"]: str(checkpoint),
            PATH_ENV["tokenizer_json"]: str(Path(run_dir) / "tokenizer.json")}


CACHED = ENCODER  # the model whose answers Triton's response cache keeps (--response-cache-mb)
CACHE_OFF, CACHE_ON = "response_cache { enable: false }", "response_cache { enable: true }"


def render_repository(dest: Path, checkpoint: Path, params: dict[str, str] | None = None, src: Path = REPO,
                      optional=(), instances: dict[str, int] | None = None, gpus: list[int] | None = None,
                      response_cache: bool = False) -> Path:
    """Copy a model repository to dest with the checkpoint, and any other parameters, written into every model
    config that declares them, and with `instances` ({model: count}) replacing those models' instance counts.
    gpus (device ids; none or empty: unchanged): every KIND_MODEL instance group (a model that runs on a GPU when
    there is one) becomes KIND_GPU on those GPUs, its count then per GPU, as Triton counts it. KIND_GPU is only
    for hosts with GPUs: Triton refuses to load it without one. A parameter no config declares, or a model not
    in the repository, is an error (parameters in optional excepted). response_cache: the encoder's answers are
    cached, keyed on its ids and its OPTIONS input, which it then requires (the cache never sees parameters)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    params = {"checkpoint": str(checkpoint), **(params or {})}
    configs = {c.parent.name: c for c in dest.glob("*/config.pbtxt")}
    for model, count in (instances or {}).items():
        if model not in configs or count < 1:
            raise ValueError(f"cannot give model {model!r} {count} instances (models: {sorted(configs)})")
    for model, cfg in sorted(configs.items()):
        text = cfg.read_text()
        groups = INSTANCE_GROUP.findall(text)
        if model in (instances or {}) and len(groups) != 1:
            raise ValueError(f"{cfg}: no single 'instance_group [ {{ count: N kind: KIND' to set")
        if len(groups) == 1:
            count, kind, placed = int(groups[0][0]), groups[0][1], [int(g) for g in groups[0][2].split(",") if g]
            count = (instances or {}).get(model, count)
            if gpus and kind == "KIND_MODEL":
                kind, placed = "KIND_GPU", gpus
            text = INSTANCE_GROUP.sub(instance_group(count, kind, placed), text)
        if response_cache and model == CACHED:
            if CACHE_OFF not in text:
                raise ValueError(f"{cfg}: no '{CACHE_OFF}' to turn the cache on with")
            text = text.replace(CACHE_OFF, CACHE_ON)
        cfg.write_text(text)
    used = set()
    for cfg in sorted(configs.values()):
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
