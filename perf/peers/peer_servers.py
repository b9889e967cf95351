"""The servers perf/peers/peers.py compares, each started as its documentation advises for an embedding model and
stopped after: ours (egemma.ops.launcher with its defaults: gateway, watchdog, instance counts), sentence-transformers
behind the same Triton (perf/serving/baseline_repository), Infinity and vLLM (from perf/peers/peers_stage.sh's
folders, on PYTHONPATH for their own process only), each through perf/lib/servers.py. Each starter is a context manager yielding {row name: loadgen.Target}."""
import importlib.util
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from egemma.ops.repository import ROOT
from egemma.ops.tritonserver import free_port
from perf.lib.loadgen import Target
from perf.lib.servers import process, triton

NAME = "google/embeddinggemma-300m"
SETTINGS = {
    "ours": "defaults (python -m egemma.ops.launcher: encoder 3 / tokenizer instances by cores, CUDA graphs, FA3 "
            "where carried); README 'Two commands'",
    "st": "SentenceTransformer(...).to(bfloat16).encode of each dynamic batch (perf/serving/baseline_repository)",
    "infinity": "v2 --engine torch --dtype bfloat16 --batch-size 128 --compile (its default) --no-bettertransformer "
                "(optimum's BetterTransformer has no Gemma3); `infinity_emb v2 --help`, "
                "https://michaelfeil.github.io/infinity (cli_v2)",
    "infinity-eager": "as infinity with --no-compile (run when the compiled one did not start)",
    "vllm": "--runner pooling --dtype bfloat16 --max-model-len 2048 --max-num-batched-tokens 16384 "
            "(8 x 2048 in one step; the H100-class default is 8192) --gpu-memory-utilization 0.5, -O2 (the default: "
            "torch.compile + FULL_AND_PIECEWISE CUDA graphs); docs.vllm.ai models/pooling_models, "
            "configuration/optimization, design/optimization_levels",
}


@contextmanager
def ours(ckpt: Path, out: Path, a):
    http, grpc, metrics = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "egemma.ops.launcher", "--model", str(ckpt), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--run-dir", str(out / "ours-run")]
    # the gateway's orjson from the peers' bundle where this Python has none (perf/peers/peers_stage.sh)
    extra = [str(a.peers_dir / "gateway")] if importlib.util.find_spec("orjson") is None else []
    env = {"PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), *extra]).strip(os.pathsep)} if extra else {}
    with process(cmd, f"http://127.0.0.1:{http}/v2/health/ready", out / "server_ours.log", 300, env):
        yield {"ours-http": Target("openai", f"http://127.0.0.1:{http}/v1/embeddings", NAME),
               "ours-grpc": Target("grpc", f"127.0.0.1:{grpc}", "embeddinggemma")}


@contextmanager
def st(ckpt: Path, out: Path, a):
    # sentence-transformers needs the host's numpy 2: its stub runs this Python (as in perf/serving/bench_serve.py)
    with triton(ckpt, out / "server_st.log", repository=ROOT / "perf" / "serving" / "baseline_repository",
                stub_bin=str(Path(sys.executable).parent), ready_timeout=300) as s:
        yield {"st": Target("grpc", s.grpc_url, "st_bf16", "TEXT_UTF8")}


@contextmanager
def infinity(ckpt: Path, out: Path, a, compile_: bool = True):
    import torch
    port, gpu = free_port(), torch.cuda.is_available()
    cmd = [a.peer_python, "-m", "infinity_emb.cli", "v2", "--model-id", str(ckpt), "--served-model-name", NAME,
           "--engine", "torch", "--device", "cuda" if gpu else "cpu", "--port", str(port), "--host", "127.0.0.1",
           "--no-bettertransformer"]
    if gpu:
        cmd += ["--dtype", "bfloat16", "--batch-size", "128", "--compile" if compile_ else "--no-compile"]
    env = {"PYTHONPATH": str(a.peers_dir / "infinity"), "INFINITY_ANONYMOUS_USAGE_STATS": "0", "HF_HUB_OFFLINE": "1"}
    name = "infinity" if compile_ else "infinity-eager"
    with process(cmd, f"http://127.0.0.1:{port}/models", out / f"server_{name}.log", 300, env):
        yield {name: Target("openai", f"http://127.0.0.1:{port}/embeddings", NAME)}


@contextmanager
def vllm(ckpt: Path, out: Path, a):
    port = free_port()
    cmd = [a.peer_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--served-model-name",
           NAME, "--runner", "pooling", "--dtype", "bfloat16", "--max-model-len", "2048",
           "--max-num-batched-tokens", "16384", "--gpu-memory-utilization", "0.5", "--host", "127.0.0.1",
           "--port", str(port)]
    env = {"PYTHONPATH": str(a.peers_dir / "vllm"), "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    with process(cmd, f"http://127.0.0.1:{port}/health", out / "server_vllm.log", 360, env):
        yield {"vllm": Target("openai", f"http://127.0.0.1:{port}/v1/embeddings", NAME)}


STARTERS = {"ours": ours, "st": st, "infinity": infinity, "vllm": vllm,
            "infinity-eager": lambda ckpt, out, a: infinity(ckpt, out, a, compile_=False)}
