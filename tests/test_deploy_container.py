"""The launcher started with exactly the container's command line (deploy/Dockerfile's ENTRYPOINT, less tini, and
the Deployment's args; only the model path, run and cache directories, the key file and ports swapped) answers every path and port the
manifests name, serves every metric the autoscaler's rule reads, fails liveness when its watchdog stops, and
exits within the grace period on SIGTERM."""
import os
import re
import signal
import sys
import time

import requests
import tritonclient.grpc as grpcclient

from helpers import Launcher, text_input, wait_for
from manifests import DEPLOY, adapter_rule, container, container_argv, rendered

KEY = "container-test-key"


def test_the_container_command_line_serves_every_probe_path_port_and_metric(checkpoints, tmp_path):
    from egemma.ops.tritonserver import free_port
    k8s = rendered("k8s")
    c = container(k8s)
    argv = container_argv(c["args"])
    assert "command" not in c  # the image's ENTRYPOINT runs
    assert argv[:5] == ["tini", "--", "python3", "-m", "egemma.ops.launcher"]
    ports = {}  # manifest port -> the free port the test serves it on
    assert "--api-key-file" in argv  # inference answers to the key; probes and metrics stay open
    run = [sys.executable, *argv[3:]]  # tini (PID 1 in the image) is not installed here
    for i, a in enumerate(run[:-1]):
        if a == "--model":
            run[i + 1] = str(checkpoints["eos"])
        elif a in ("--run-dir", "--cache-dir"):
            run[i + 1] = str(tmp_path / a[2:].split("-")[0])  # run, cache
        elif a == "--api-key-file":  # the mounted secret
            (tmp_path / "api-key").write_text(KEY + "\n")
            run[i + 1] = str(tmp_path / "api-key")
        elif a.endswith("-port"):
            ports[int(run[i + 1])] = free_port()
            run[i + 1] = str(ports[int(run[i + 1])])
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert set(named.values()) <= set(ports), (named, ports)
    la = Launcher(run, tmp_path / "launcher", cwd=tmp_path)
    try:
        la.wait_ready()
        la.server_pid()  # the tritonserver it started, ended by close() whatever happens
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
        assert r.status_code == 401, r.text
        r = requests.post(url("http", "/v2/models/embeddinggemma/infer"), json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
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
            "embeddinggemma", [text_input(["over grpc"])],
            headers={"triton-grpc-protocol-api-key": KEY}).as_numpy("EMBEDDING")
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
        la.proc.send_signal(signal.SIGTERM)  # what the kubelet sends after preStop (tini forwards it)
        assert la.proc.wait(grace - pre_stop) == 0
        print(f"SIGTERM: exited in {time.monotonic() - t0:.1f}s (grace period {grace}s, preStop {pre_stop}s)")
    finally:
        la.close()
