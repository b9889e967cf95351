"""deploy/: the container's install step (scripts/setup.sh --system, what deploy/Dockerfile runs) into a fresh
interpreter; the Kubernetes and KServe manifests rendered offline (`kubectl kustomize`), every core object
validated against the Kubernetes schemas, the CRDs (KServe, Prometheus operator) checked structurally and against
each other, and a security scanner (checkov) clean; the hub refusing the gated model is a clear error; and the
launcher started with exactly the container's command line (only the model path, run directory and ports
swapped) answers every path and port the manifests name, with every metric the autoscaler's rule reads."""
import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml

from egemma.ops.procfs import children, gone
from helpers import ROOT, text_input, wait_for

DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.32.0"  # the oldest Kubernetes these manifests are meant for
CHECKOV = "checkov==3.3.30"  # in its own venv under .cache: its pins clash with the test environment's


def kustomize(path: Path) -> list[dict]:
    if not shutil.which("kubectl"):
        pytest.skip("kubectl (kustomize) is not installed: apt-get install kubernetes-client, or google-cloud-cli's")
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs) -> dict[str, dict]:
    out = {}
    for o in objs:
        assert o["kind"] not in out, f"two {o['kind']} objects"
        out[o["kind"]] = o
    return out


@pytest.fixture(scope="module")
def k8s():
    return by_kind(kustomize(DEPLOY / "k8s"))


@pytest.fixture(scope="module")
def kserve():
    return by_kind(kustomize(DEPLOY / "kserve"))


def container(k8s) -> dict:
    (c,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    return rule


# ---------------------------------------------------------------------------------------------- install step

def test_setup_system_mode_installs_into_an_existing_interpreter(tmp_path):
    """deploy/Dockerfile's RUN step, `PYTHON=python3 scripts/setup.sh --system`, into a fresh interpreter that is
    not setup.sh's venv (it stands for the image's python3; its packages are those of this test environment,
    so nothing is downloaded but the build backend): the project then imports there, from this checkout."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^RUN PYTHON=python3 .*scripts/setup\.sh --system", dockerfile, re.M)
    target = tmp_path / "image-python"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(target)], check=True, timeout=120)
    py = target / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = [py, "-c", "import egemma.ops.launcher, sys; print(egemma.ops.launcher.__file__, sys.prefix)"]
    assert subprocess.run(probe, cwd=tmp_path, capture_output=True).returncode != 0  # not there before
    env = {**os.environ, "PYTHON": str(py)}
    run = subprocess.run([ROOT / "scripts" / "setup.sh", "--system"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"[setup] installing packages into {target}" in run.stdout and "[setup] done" in run.stdout
    where, prefix = subprocess.run(probe, cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert Path(where) == ROOT / "egemma" / "ops" / "launcher.py" and Path(prefix) == target
    assert not (ROOT / ".venv").samefile(target)
    bad = subprocess.run([ROOT / "scripts" / "setup.sh"], env={**env, "EGEMMA_SETUP": "nope"}, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unknown mode" in bad.stderr


# ---------------------------------------------------------------------------------------------- manifests

def test_core_objects_validate_against_the_kubernetes_schemas(k8s, kserve):
    import kubernetes_validate
    core = [o for o in [*k8s.values(), *kserve.values()] if "monitoring.coreos.com" not in o["apiVersion"]
            and "serving.kserve.io" not in o["apiVersion"]]
    assert {o["kind"] for o in core} >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                                         "NetworkPolicy", "ServiceAccount"}
    for o in core:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    # The KServe runtime's container and volumes are core types: validated as a Pod.
    sr = kserve["ServingRuntime"]["spec"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "runtime"},
                                  "spec": {"containers": sr["containers"], "volumes": sr["volumes"]}},
                                 K8S_VERSION, strict=True)
    broken = json.loads(json.dumps(k8s["Deployment"]))  # the validator does reject a wrong field
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_objects_fit_together(k8s):
    dep, pod = k8s["Deployment"], k8s["Deployment"]["spec"]["template"]
    labels, c = pod["metadata"]["labels"], container(k8s)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert sorted(ports.values()) == [8000, 8001, 8002]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    for sel in (dep["spec"]["selector"]["matchLabels"], k8s["Service"]["spec"]["selector"],
                k8s["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                k8s["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"],
                k8s["PodMonitor"]["spec"]["selector"]["matchLabels"]):
        assert sel.items() <= labels.items(), sel
    assert {p["targetPort"] for p in k8s["Service"]["spec"]["ports"]} == set(ports)
    assert {p["port"] for r in k8s["NetworkPolicy"]["spec"]["ingress"] for p in r["ports"]} == set(ports.values())
    assert k8s["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert pod["spec"]["serviceAccountName"] == k8s["ServiceAccount"]["metadata"]["name"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ports, probe
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # The startup probe allows loading + graph capture; liveness outlasts several in-place restarts.
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 600
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 90
    args = c["args"]
    drain = int(args[args.index("--exit-timeout-secs") + 1])
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pre_stop + drain + 15
    assert args[args.index("--host") + 1] == "0.0.0.0"
    volumes = {v["name"] for v in pod["spec"]["volumes"]}
    assert {m["name"] for m in c["volumeMounts"]} == volumes
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] and pod["spec"]["securityContext"]["runAsUser"] >= 10000
    # Every path the launcher writes lies on a volume (the root filesystem is read-only).
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    for path in (args[args.index("--run-dir") + 1], "/tmp", "/var/cache/huggingface"):
        assert any(path == m or path.startswith(m + "/") for m in mounts), path


def test_custom_resources_are_well_formed(k8s, kserve):
    pm = k8s["PodMonitor"]
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["metadata"]["namespace"]
    (ep,) = pm["spec"]["podMetricsEndpoints"]
    assert ep["port"] in {p["name"] for p in container(k8s)["ports"]} and ep["path"] == "/metrics"
    assert re.fullmatch(r"\d+s", ep["interval"])
    hpa = k8s["HorizontalPodAutoscaler"]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == adapter_rule()["name"]["as"]
    rule = adapter_rule()
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]

    sr, isvc = kserve["ServingRuntime"], kserve["InferenceService"]
    assert sr["apiVersion"] == "serving.kserve.io/v1alpha1" and isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert set(sr["spec"]["protocolVersions"]) <= {"v1", "v2", "grpc-v2"}
    (rc,) = sr["spec"]["containers"]
    assert rc["name"] == "kserve-container" and all(isinstance(a, str) for a in rc["args"])
    assert rc["image"] == container(k8s)["image"]  # the same image
    pred = isvc["spec"]["predictor"]
    model = pred["model"]
    assert model["runtime"] == sr["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in sr["spec"]["supportedModelFormats"]}
    assert re.match(r"^(hf|pvc|s3|gs)://", model["storageUri"])
    assert pred["scaleMetric"] in ("cpu", "memory", "concurrency", "rps") and pred["minReplicas"] >= 1
    assert pred["serviceAccountName"] == kserve["ServiceAccount"]["metadata"]["name"]
    # The same launcher as the Deployment: only the model path (KServe's /mnt/models) and ports differ.
    ka, da = rc["args"], container(k8s)["args"]
    assert ka[ka.index("--model") + 1] == "/mnt/models"
    assert _strip(ka) == _strip(da)
    http = int(ka[ka.index("--http-port") + 1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rc[probe]["httpGet"]["port"] == http
        assert rc[probe]["httpGet"]["path"] == container(k8s)[probe]["httpGet"]["path"]


def _strip(args):
    """args without the values of --model and the ports."""
    return [a for i, a in enumerate(args) if i == 0 or not (args[i - 1] == "--model" or args[i - 1].endswith("-port"))]


def _checkov() -> Path:
    venv = ROOT / ".cache" / "checkov-venv"
    exe = venv / "bin" / "checkov"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "-q", CHECKOV], check=True, timeout=900)
    return exe


def test_manifests_and_dockerfile_pass_the_security_scanner(tmp_path):
    """checkov on the rendered manifests and the Dockerfile: no failed check; every skipped one says why."""
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for name in ("k8s", "kserve"):
        docs = kustomize(DEPLOY / name)
        (rendered / f"{name}.yaml").write_text(yaml.safe_dump_all(docs))
    exe = _checkov()
    files = [str(p) for p in (rendered / "k8s.yaml", rendered / "kserve.yaml", DEPLOY / "Dockerfile")]
    out = subprocess.run([exe, "-f", *files, "--framework", "kubernetes", "dockerfile", "--skip-download", "-o",
                          "json"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "BC_API_KEY": ""})
    reports = json.loads(out.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}, out.stdout[:500]
    for r in reports:
        failed = [(c["check_id"], c["check_name"], c["resource"]) for c in r["results"]["failed_checks"]]
        assert not failed, failed
        assert r["summary"]["passed"] > 20
        for c in r["results"].get("skipped_checks", []):
            assert len(c["check_result"].get("suppress_comment") or "") > 20, c
    skipped = {c["check_id"] for r in reports for c in r["results"].get("skipped_checks", [])}
    assert skipped == {"CKV_K8S_43"}, skipped  # the image digest: the user's build (deploy/k8s/deployment.yaml)


# ---------------------------------------------------------------------------------------------- the gated hub

class Refusing(http.server.BaseHTTPRequestHandler):
    """The hub as a gated model answers without access."""
    status, gated = 401, True

    def do_GET(self):
        self.send_response(self.status)
        if self.gated:
            self.send_header("X-Error-Code", "GatedRepo")
            self.send_header("X-Error-Message", "Access to model google/embeddinggemma-300m is restricted.")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "restricted"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING", "EMBEDDINGGEMMA"))}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{srv.server_address[1]}", HF_HOME=str(tmp_path / "hf"))
    yield env
    srv.shutdown()


@pytest.mark.parametrize("status, gated, args, extra", [
    (401, True, ["--model", "google/embeddinggemma-300m"], {}),
    (403, False, [], {"HF_TOKEN": "hf_not_a_real_token"}),
])
def test_a_hub_refusal_is_a_clear_error_never_the_demo(hub, tmp_path, monkeypatch, status, gated, args, extra):
    monkeypatch.setattr(Refusing, "status", status)
    monkeypatch.setattr(Refusing, "gated", gated)
    run = subprocess.run([sys.executable, "-m", "egemma.ops.launcher", *args, "--run-dir", str(tmp_path / "run"),
                          "--http-port", "1", "--grpc-port", "2", "--metrics-port", "3"],
                         env={**hub, **extra}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    err = run.stderr
    assert f"HTTP {status}" in err and "gated" in err and "HF_TOKEN" in err and "Not falling back" in err, err
    assert ("the token given was refused" in err) == bool(extra), err
    assert "DEMO" not in err and "starting tritonserver" not in run.stdout


def test_without_a_model_asked_for_the_demo_checkpoint_serves(hub, tmp_path):
    code = "from egemma.ops.repository import resolve_checkpoint; print(resolve_checkpoint(None))"
    run = subprocess.run([sys.executable, "-c", code], env=hub, capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "DEMO checkpoint with RANDOM weights" in run.stderr and run.stdout.strip().endswith("demo-checkpoint")


# ---------------------------------------------------------------------------------------------- the container

def container_argv(k8s) -> list[str]:
    """The container's command: the Dockerfile's ENTRYPOINT (exec form) with the Deployment's args (which replace
    its CMD)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (entry,) = re.findall(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M)
    c = container(k8s)
    assert "command" not in c
    return [*json.loads(entry), *c["args"]]


class Launched:
    """The launcher in a subprocess; close() ends it and every tritonserver it ran (their own sessions)."""

    def __init__(self, argv, d: Path):
        d.mkdir(parents=True)
        self.out, self.err = open(d / "stdout", "w+"), open(d / "stderr", "w+")
        self.proc = subprocess.Popen(argv, cwd=d, stdout=self.out, stderr=self.err)
        self.servers: set[int] = set()

    def text(self) -> str:
        self.out.flush()
        return Path(self.out.name).read_text()

    def watch(self):
        self.servers |= {p for p, a in children(self.proc.pid).items() if os.path.basename(a[0]) == "tritonserver"}

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for p in self.servers:
            if not gone(p):
                os.killpg(p, signal.SIGKILL)
        self.out.close()
        self.err.close()


def test_the_container_command_line_serves_every_probe_path_port_and_metric(k8s, checkpoints, tmp_path):
    from egemma.ops.tritonserver import free_port
    argv, c = container_argv(k8s), container(k8s)
    assert argv[:3] == ["python3", "-m", "egemma.ops.launcher"]
    ports = {}  # manifest port -> the free port the test serves it on
    run = [sys.executable, *argv[1:]]
    for i, a in enumerate(run[:-1]):
        if a == "--model":
            run[i + 1] = str(checkpoints["eos"])
        elif a == "--run-dir":
            run[i + 1] = str(tmp_path / "run")
        elif a.endswith("-port"):
            ports[int(run[i + 1])] = free_port()
            run[i + 1] = str(ports[int(run[i + 1])])
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert set(named.values()) <= set(ports), (named, ports)
    la = Launched(run, tmp_path / "launcher")
    try:
        wait_for(lambda: "ready:" in la.text() or la.proc.poll() is not None, 300, "the launcher to print ready")
        la.watch()  # the tritonserver it started, ended by close() whatever happens
        assert la.proc.poll() is None, Path(la.err.name).read_text()[-3000:]
        # On this host (no GPU) the encoder stays KIND_MODEL: Triton refuses KIND_GPU without one.
        from egemma.ops.host import visible_gpus
        if not visible_gpus():
            cfg = tmp_path / "run" / "model_repository" / "embeddinggemma_encoder" / "config.pbtxt"
            assert "kind: KIND_MODEL" in cfg.read_text()

        def url(port, path):
            port = named.get(port, port)
            return f"http://127.0.0.1:{ports[port]}{path}"
        body = {"inputs": [{"name": "TEXT", "shape": [2, 1], "datatype": "BYTES", "data": ["probe", "metrics"]}]}
        r = requests.post(url("http", "/v2/models/embeddinggemma/infer"), json=body, timeout=60)
        assert r.status_code == 200, r.text
        hit = []
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            g = c[probe]["httpGet"]
            hit.append((probe, g["port"], g["path"], requests.get(url(g["port"], g["path"]), timeout=10).status_code))
        (ep,) = k8s["PodMonitor"]["spec"]["podMetricsEndpoints"]
        scrape = requests.get(url(ep["port"], ep["path"]), timeout=10)
        hit.append(("PodMonitor", ep["port"], ep["path"], scrape.status_code))
        healthcheck = re.search(r"urlopen\('http://127\.0\.0\.1:(\d+)(/[^']*)'", (DEPLOY / "Dockerfile").read_text())
        hit.append(("HEALTHCHECK", int(healthcheck[1]), healthcheck[2],
                    requests.get(url(int(healthcheck[1]), healthcheck[2]), timeout=10).status_code))
        for sp in k8s["Service"]["spec"]["ports"]:  # every Service port answers its protocol
            port = named[sp["targetPort"]]
            if sp["name"] == "grpc":
                ok = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[port]}").is_server_ready()
                hit.append(("Service grpc", port, "ServerReady", 200 if ok else 503))
            else:
                path = "/metrics" if sp["name"] == "metrics" else "/v2/health/ready"
                hit.append((f"Service {sp['name']}", port, path, requests.get(url(port, path), timeout=10).status_code))
        assert all(status == 200 for *_, status in hit), hit
        print("\n".join(f"{w}: {p} {path} -> {s}" for w, p, path, s in hit))
        got = grpcclient.InferenceServerClient(f"127.0.0.1:{ports[named['grpc']]}").infer(
            "embeddinggemma", [text_input(["over grpc"])]).as_numpy("EMBEDDING")
        assert got.shape[0] == 1

        # Every series the autoscaling rule reads is served under that name, with the labels it filters on.
        rule = adapter_rule()
        query = rule["seriesQuery"] + " " + rule["metricsQuery"]
        series = {}
        for line in scrape.text.splitlines():
            if line and not line.startswith("#"):
                series.setdefault(re.split(r"[{ ]", line, maxsplit=1)[0], []).append(line)
        names = set(re.findall(r"\b(nv_[a-z_]+|egemma_[a-z_]+)\{", query))
        assert names >= {"nv_inference_queue_duration_us", "nv_inference_request_success"}, names
        for name in names:
            assert name in series, (name, sorted(series))
        for name, op, value in re.findall(r"\b(nv_[a-z_]+)\{[^}]*?model(=~?)\"([^\"]+)\"", query):
            models = value.split("|") if op == "=~" else [value]
            for m in models:
                assert any(f'model="{m}"' in s for s in series[name]), (name, m, series[name])
        success = [s for s in series["nv_inference_request_success"] if 'model="embeddinggemma"' in s]
        assert float(success[0].rsplit(" ", 1)[1]) >= 1  # the request above (and canaries), counted

        # Liveness is the watchdog's verdict: a watchdog that stops checking (its process frozen) fails it, and
        # it passes again once the watchdog runs.
        live = url(c["livenessProbe"]["httpGet"]["port"], c["livenessProbe"]["httpGet"]["path"])
        assert requests.get(live, timeout=10).json() == {"live": True, "why": "serving"}
        os.kill(la.proc.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: requests.get(live, timeout=10).status_code == 503, 60, "liveness to fail, stale verdict")
            assert "old" in requests.get(live, timeout=10).json()["why"]
        finally:
            os.kill(la.proc.pid, signal.SIGCONT)
        wait_for(lambda: requests.get(live, timeout=10).status_code == 200, 60, "liveness to pass again")

        grace = k8s["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        t0 = time.monotonic()
        la.proc.send_signal(signal.SIGTERM)  # what the kubelet sends after preStop
        assert la.proc.wait(grace - pre_stop) == 0
        print(f"SIGTERM: exited in {time.monotonic() - t0:.1f}s (grace period {grace}s, preStop {pre_stop}s)")
    finally:
        la.close()
