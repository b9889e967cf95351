"""Every GPU of a host: the encoder's instance group as rendered for 0, 1 and several GPUs (KIND_GPU only where
there are GPUs: Triton refuses it without one), the --gpus option and the GPU count read without torch, the
tokenizer's instance rule, and the encoder adapter placing its engine on the device Triton passes (its
initialize run on a real engine with Triton's args; KIND_GPU without that GPU fails loudly). The real
multi-GPU run is tests marked for GPU hosts here and the 2-GPU issue's."""
import importlib.util
import json
import logging
import re
import sys
import types

import pytest
import torch

from egemma.ops.host import cuda_numbered, default_instances, parse_gpus, tokenizer_instances, visible_gpus
from egemma.ops.repository import REPO, render_repository
from egemma.spec import ENCODER, ENSEMBLE, MAX_BATCH, TOKENIZER
from helpers import ROOT, text_input

PARAMETER = re.compile(r'parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}')


def _groups(repo):
    return {m: (repo / m / "config.pbtxt").read_text().split("instance_group ", 1)[1].split("\n", 1)[0]
            for m in (ENCODER, TOKENIZER)}


@pytest.mark.parametrize("gpus, instances, encoder", [
    (None, {}, "[ { count: 3 kind: KIND_MODEL } ]"),  # a CPU host: what the launcher renders there
    ([], {ENCODER: 1}, "[ { count: 1 kind: KIND_MODEL } ]"),
    ([0], {}, "[ { count: 3 kind: KIND_GPU gpus: [ 0 ] } ]"),
    ([0, 1, 3], {}, "[ { count: 3 kind: KIND_GPU gpus: [ 0, 1, 3 ] } ]"),
    ([0, 1], {ENCODER: 4, TOKENIZER: 8}, "[ { count: 4 kind: KIND_GPU gpus: [ 0, 1 ] } ]"),
])
def test_encoder_instance_group_for_0_1_and_several_gpus(checkpoints, tmp_path, gpus, instances, encoder):
    repo = render_repository(tmp_path / "repo", checkpoints["eos"], instances=instances, gpus=gpus)
    got = _groups(repo)
    assert got[ENCODER] == encoder
    tokenizers = instances.get(TOKENIZER, 4)
    assert got[TOKENIZER] == f"[ {{ count: {tokenizers} kind: KIND_CPU }} ]"  # never placed
    again = _groups(render_repository(tmp_path / "again", checkpoints["eos"], src=repo, gpus=[2]))[ENCODER]
    assert again == (encoder if gpus else encoder.replace("KIND_MODEL", "KIND_GPU gpus: [ 2 ]"))  # placed once


def test_kind_cpu_models_are_never_placed(tmp_path, checkpoints):
    repo = render_repository(tmp_path / "spin", checkpoints["eos"], src=ROOT / "tests" / "spin_repository",
                             instances={"embeddinggemma": 2}, gpus=[0, 1])
    assert "instance_group [ { count: 2 kind: KIND_CPU } ]" in (repo / "embeddinggemma" / "config.pbtxt").read_text()


def test_gpus_option_and_cuda_numbering():
    assert parse_gpus("all", [0, 1, 2]) == [0, 1, 2] and parse_gpus("all", []) == []
    assert parse_gpus("2,0", [0, 1, 2]) == [2, 0]
    for bad in ("0,0", "3", "x", "0,"):
        with pytest.raises(ValueError, match="--gpus"):
            parse_gpus(bad, [0, 1, 2])
    with pytest.raises(ValueError, match="none"):
        parse_gpus("0", [])
    assert cuda_numbered(4, None) == 4
    assert cuda_numbered(4, "2,3") == 2 and cuda_numbered(4, "") == 0 and cuda_numbered(4, "1,9,2") == 1
    assert cuda_numbered(2, "GPU-8a2b,MIG-1c") == 2 and cuda_numbered(0, "0") == 0
    if not torch.cuda.is_available():  # counted without torch; on a CPU host, none: the launcher keeps KIND_MODEL
        assert visible_gpus() == []
    else:
        assert len(visible_gpus()) == torch.cuda.device_count()


def test_tokenizer_instances_follow_the_cores():
    assert tokenizer_instances(16, 1) == 4  # the measured point: an H200 host with 16 cores
    assert tokenizer_instances(2, 1) == 1 and tokenizer_instances(1, 0) == 1
    assert tokenizer_instances(64, 1) == 4  # one GPU's encoders are fed by 4
    assert tokenizer_instances(64, 8) == 16 and tokenizer_instances(128, 8) == 32


def test_the_repository_counts_are_the_hosts_defaults():
    """A bare `tritonserver --model-repository=model_repository` gets the counts egemma.ops.host renders for the
    measured host (16 cores, one GPU): Triton needs a count in config.pbtxt, egemma.ops.host owns its value."""
    counts = {m: int(g.split("count: ")[1].split()[0]) for m, g in _groups(REPO).items()}
    assert counts == default_instances(True, 16, 1)
    assert default_instances(False, 16, 1) == {ENCODER: 1, TOKENIZER: 2}


def test_the_repository_batch_is_the_products():
    """The ensemble's and the tokenizer's max_batch_size (Triton needs it written in config.pbtxt) are egemma.spec's
    MAX_BATCH, which the gateway, the token budget and the client size themselves by."""
    sizes = {c.parent.name: int(re.search(r"^max_batch_size: (\d+)", c.read_text(), re.M).group(1))
             for c in REPO.glob("*/config.pbtxt")}
    assert {m: n for m, n in sizes.items() if m != ENCODER} == {ENSEMBLE: MAX_BATCH, TOKENIZER: MAX_BATCH}


def test_the_repository_parameters_are_all_empty():
    """Every model parameter of the shipped config.pbtxt files is empty: each default is defined once, in the code
    that reads the parameter (egemma.engine.config.EngineConfig, egemma.engine.tokenizer, egemma.spec,
    egemma.stub.budget), and a path never stands in a config Triton serves to any client. The keys stay: they show
    what `--param` can set."""
    texts = {c.parent.name: c.read_text() for c in REPO.glob("*/config.pbtxt")}
    params = {(m, k): v for m, t in texts.items() for k, v in re.findall(PARAMETER, t)}
    assert len(params) == sum(t.count("parameters {") for t in texts.values()) > 0  # every one read
    assert {k: v for k, v in params.items() if v} == {}


# ------------------------------------------------------------------------------ the adapter's initialize

@pytest.fixture
def encoder_model(monkeypatch):
    """model_repository's encoder model.py, imported as the stub would, with a stand-in for the C half of
    triton_python_backend_utils (MetricFamily), which exists only inside the stub process."""
    class MetricFamily:
        COUNTER = "counter"

        def __init__(self, name, description, kind):
            self.name = name

        def Metric(self, labels):
            return types.SimpleNamespace(increment=lambda v: None)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils",
                        types.SimpleNamespace(MetricFamily=MetricFamily, InferenceResponse=object, Tensor=object,
                                              TritonError=object))
    spec = importlib.util.spec_from_file_location("encoder_model_py", REPO / ENCODER / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TritonPythonModel


def _args(repo, kind, device_id, name="embeddinggemma_encoder_0_0"):
    """What Triton's Python backend passes to initialize (every value a string)."""
    cfg = (repo / ENCODER / "config.pbtxt").read_text()
    params = dict(PARAMETER.findall(cfg))
    return {"model_config": json.dumps({"name": ENCODER, "parameters": {k: {"string_value": v}
                                                                         for k, v in params.items()}}),
            "model_instance_kind": kind, "model_instance_device_id": str(device_id), "model_instance_name": name,
            "model_repository": str(repo / ENCODER), "model_version": "1", "model_name": ENCODER}


@pytest.fixture
def rendered(checkpoints, tmp_path):
    return render_repository(tmp_path / "repo", checkpoints["eos"], {"matryoshka_dims": "48,32,16"})


def test_initialize_builds_the_engine_where_triton_placed_it(encoder_model, rendered, tmp_path, monkeypatch,
                                                              caplog):
    """KIND_CPU: the engine runs on the CPU, on a GPU host too; the log line names the device; the instance's
    heartbeat file is there, outside any execute."""
    from egemma.stub.instance import HEARTBEAT_DIR, read_heartbeats
    monkeypatch.setenv(HEARTBEAT_DIR, str(tmp_path))
    m = encoder_model()
    with caplog.at_level(logging.INFO, logger="egemma"):
        m.initialize(_args(rendered, "CPU", 0, "embeddinggemma_encoder_0_1"))
    assert m.engine.device == torch.device("cpu")
    assert m.engine.embed([torch.arange(5).numpy()]).shape == (1, 48)
    assert "egemma: encoder instance embeddinggemma_encoder_0_1 on cpu" in caplog.text
    begin, end, pid, tokens = read_heartbeats(tmp_path)["embeddinggemma_encoder_0_1"]
    assert (begin, end, tokens) == (0.0, 0.0, 0) and pid > 0


def test_kind_model_auto_runs_on_a_concrete_device(encoder_model, rendered, caplog):
    """KIND_MODEL (what the launcher renders without --gpus): "auto" is the current CUDA device, named cuda:N in
    the log line, or the CPU on a host without a GPU."""
    want = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    m = encoder_model()
    with caplog.at_level(logging.INFO, logger="egemma"):
        m.initialize(_args(rendered, "MODEL", 0, "embeddinggemma_encoder_0_2"))
    assert m.engine.device == torch.device(want)
    assert f"egemma: encoder instance embeddinggemma_encoder_0_2 on {want}" in caplog.text


def test_kind_gpu_without_that_gpu_fails_loudly(encoder_model, rendered):
    """Triton refuses KIND_GPU on a host without GPUs; a stub that sees fewer GPUs than the server placed it on
    (another CUDA_VISIBLE_DEVICES) must not run on the CPU or on another GPU."""
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0  # one past the last: never there
    with pytest.raises(RuntimeError, match=f"GPU {missing} \\(KIND_GPU\\).*CUDA device"):
        encoder_model().initialize(_args(rendered, "GPU", missing))


@pytest.mark.parametrize("device, kind, placed", [("cpu", "GPU", "on GPU 1"), ("cuda:0", "CPU", "on the CPU")])
def test_a_device_parameter_contradicting_the_placement_is_an_error(encoder_model, checkpoints, tmp_path, device,
                                                                    kind, placed):
    repo = render_repository(tmp_path / "r", checkpoints["eos"])
    cfg = repo / ENCODER / "config.pbtxt"
    assert 'key: "device"' not in cfg.read_text()
    cfg.write_text(cfg.read_text() + f'parameters {{ key: "device" value: {{ string_value: "{device}" }} }}\n')
    with pytest.raises(ValueError, match=f"contradicts Triton's placement {placed}"):
        encoder_model().initialize(_args(repo, kind, 1))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_each_instance_runs_on_its_gpu(encoder_model, rendered):
    """On a host with 2+ GPUs: the instance Triton puts on GPU 1 builds its engine, graphs and all, there and gives
    the embeddings of the one on GPU 0."""
    a, b = encoder_model(), encoder_model()
    a.initialize(_args(rendered, "GPU", 0, "embeddinggemma_encoder_0_0"))
    b.initialize(_args(rendered, "GPU", 1, "embeddinggemma_encoder_0_3"))
    assert a.engine.device == torch.device("cuda:0") and b.engine.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 1
    ids = [torch.arange(3, 40).numpy()]
    assert torch.allclose(torch.from_numpy(a.engine.embed(ids)), torch.from_numpy(b.engine.embed(ids)), atol=1e-3)


# ------------------------------------------------------------------------------ through the real server

def test_served_instances_log_their_device_and_stamp_heartbeats(server):
    """The real Triton args: one log line per encoder instance naming its device, one per tokenizer instance naming
    its backend (the C tokenizer: the test checkpoint is Gemma-like), and a heartbeat per instance of both models
    whose last execute has ended."""
    import tritonclient.grpc as grpcclient
    from egemma.ops.procfs import stub_pids
    from egemma.stub.instance import read_heartbeats
    grpcclient.InferenceServerClient(server.grpc_url).infer("embeddinggemma", [text_input(["placed"])])
    log = (server.run_dir / "tritonserver.log").read_text(errors="replace")
    assert "kind: KIND_MODEL" in (server.repo / ENCODER / "config.pbtxt").read_text()  # TritonServer's default
    encoders = [m for m in stub_pids(server.proc.pid).values() if ENCODER in m]
    lines = [line for line in log.splitlines() if "egemma: encoder instance" in line]
    assert len(lines) == len(encoders) >= 1, lines
    assert all(line.rstrip().endswith((" on cpu", " on cuda:0")) for line in lines), lines
    tokenizers = [m for m in stub_pids(server.proc.pid).values() if TOKENIZER in m]
    lines = [line for line in log.splitlines() if "egemma: tokenizer backend" in line]
    assert len(lines) == len(tokenizers) >= 1 and all("backend c (egemma/kernels/bpe.c" in line for line in lines), \
        lines
    beats = read_heartbeats(server.heartbeat_dir)
    assert set(beats) >= {"embeddinggemma_encoder_0_0", "embeddinggemma_tokenizer_0_0"}, beats
    assert {pid for _, _, pid, _ in beats.values()} <= set(stub_pids(server.proc.pid))
    assert all(end >= begin for begin, end, *_ in beats.values()), beats  # none left inside an execute
    for model in (ENCODER, TOKENIZER):  # the request went through one instance of each
        assert any(begin > 0 for name, (begin, *_) in beats.items() if name.startswith(model + "_")), beats
