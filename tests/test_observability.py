"""The metrics an operator reads, against a real Prometheus (tests/prom.py): it scrapes the gateway's GET /metrics
(Triton's metrics and the gateway's own) of a running server under load, and every PromQL expression shipped is
evaluated on what it scraped: the recording and alert rules (deploy/k8s/prometheusrule.yaml, each rule's health
included), every panel of the Grafana dashboard (deploy/grafana/embeddinggemma.json), the prometheus-adapter rule
the HPA reads (its template filled in as the adapter fills it). promtool checks the rules and fires each alert in
its unit tests (tests/promtool/alerts_test.yaml). No label value carries a request's text."""
import json
import re
import shutil
import subprocess
import threading

import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml

from helpers import ROOT, text_input
from prom import ADAPTER, DASHBOARD, Prometheus, binary, labelled, rules_file, value
from rawhttp import INFER, start_front, text_request

NS, POD = "embeddinggemma", "embeddinggemma-0"
SECRET = "zqxSecretUserText"  # sent as texts and as a model name: never a label value
INFERENCE_ROUTES = ("openai_embeddings", "tei_embed", "kserve_infer")
CPU_EMPTY = ("nv_gpu_",)  # panels of GPU metrics: no series on a host without a GPU


def test_promtool_checks_the_rules_and_fires_every_alert(tmp_path):
    rules = rules_file(tmp_path)
    out = subprocess.run([binary("promtool"), "check", "rules", str(rules)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    shutil.copy(ROOT / "tests" / "promtool" / "alerts_test.yaml", tmp_path)
    alerts = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"] if "alert" in r}
    tested = set(re.findall(r"alertname: (\w+)", (tmp_path / "alerts_test.yaml").read_text()))
    assert alerts == tested, f"alerts without a unit test: {alerts - tested}"
    out = subprocess.run([binary("promtool"), "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


class Load:
    """Requests of every kind on a thread until stopped (bounded: at most `limit` rounds): the gateway's routes,
    refusals (413, 404, 422, an unknown model), and gRPC straight to Triton."""

    def __init__(self, gateway, server, limit: int = 2000):
        self.gateway, self.server, self.limit = gateway, server, limit
        self.stop, self.rounds, self.errors = threading.Event(), 0, []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        url, g = self.gateway.url, grpcclient.InferenceServerClient(self.server.grpc_url)
        s = requests.Session()
        while not self.stop.is_set() and self.rounds < self.limit:
            try:
                texts = [f"{SECRET} round {self.rounds}", "hello world " * (1 + self.rounds % 20)]
                assert s.post(f"{url}/v1/embeddings", json={"input": texts}, timeout=60).status_code == 200
                assert s.post(f"{url}/embed", json={"inputs": texts[0]}, timeout=60).status_code == 200
                assert s.post(f"{url}{INFER}", data=text_request(data=[texts[0]]), timeout=60).status_code == 200
                g.infer("embeddinggemma", [text_input(texts)], client_timeout=60)
                if self.rounds % 5 == 0:
                    assert s.post(f"{url}/embed", data=b"x" * 70_000, timeout=60).status_code == 413
                    assert s.get(f"{url}/{SECRET}", timeout=60).status_code == 404
                    assert s.post(f"{url}/embed", json={"inputs": 5}, timeout=60).status_code == 422
                    assert s.post(f"{url}/v2/models/{SECRET}/infer", data=text_request(), timeout=60).status_code >= 400
            except Exception as e:  # said at the end, not swallowed
                self.errors.append(e)
                return
            self.rounds += 1

    def end(self):
        self.stop.set()
        self.thread.join(120)
        assert not self.errors, self.errors


@pytest.fixture(scope="module")
def scraped(server, tmp_path_factory):
    """(Prometheus scraping the gateway before `server` while load runs, the gateway, the verdict file)."""
    from egemma.gateway import common
    d = tmp_path_factory.mktemp("observability")
    verdict, beat = d / "health.json", threading.Event()
    common.write_verdict(verdict, True)

    def watchdog():  # the launcher's watchdog writes its verdict every few seconds: so does this stand-in
        while not beat.wait(2):
            common.write_verdict(verdict, True, restarts=int(restarted.is_set()))
    restarted = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()
    gw = start_front(server, d / "gateway.log", "--workers=2", f"--triton-metrics={server.host}:{server.metrics_port}",
                     f"--stats-dir={server.heartbeat_dir}", f"--health-file={verdict}", "--max-request-bytes=65536")
    load = Load(gw, server)
    p = Prometheus(d, [(f"127.0.0.1:{gw.port}", {"namespace": NS, "pod": POD})], rules_file(d))
    try:
        p.series("namespace_pod:egemma_requests:rate1m > 0")
        restarted.set()
        p.series("egemma_watchdog_restarts_total > 0")
        for rule in ("namespace_pod_route:egemma_request_duration_seconds:p50_1m",
                     "namespace_pod_route:egemma_request_duration_seconds:p99_1m",
                     "namespace_route:egemma_request_duration_seconds:p99_5m"):  # each route's rate has 2 samples
            p.series(f'count({rule}{{route=~"{"|".join(INFERENCE_ROUTES)}"}} >= 0) == {len(INFERENCE_ROUTES)}')
        yield p, gw, verdict
    finally:
        load.end()
        p.stop()
        beat.set()
        gw.stop()


def _rules():
    spec = yaml.safe_load((ROOT / "deploy" / "k8s" / "prometheusrule.yaml").read_text())["spec"]
    return {r.get("record") or r["alert"]: r for g in spec["groups"] for r in g["rules"]}


def test_every_rule_is_healthy_and_recorded(scraped):
    p, _, _ = scraped
    with requests.get(f"http://127.0.0.1:{p.port}/api/v1/rules", timeout=10) as r:
        groups = r.json()["data"]["groups"]
    health = {(r.get("name")): (r["health"], r.get("lastError")) for g in groups for r in g["rules"]}
    assert set(health) == set(_rules()) and all(h == "ok" for h, _ in health.values()), health
    pod = (("namespace", NS), ("pod", POD))
    assert value(p.series("namespace_pod:egemma_requests:rate1m")[0]) > 0
    assert value(p.series("namespace_pod:egemma_inferences:rate1m")[0]) > 0
    p50 = labelled(p.series("namespace_pod_route:egemma_request_duration_seconds:p50_1m"))
    p99 = labelled(p.series("namespace_pod_route:egemma_request_duration_seconds:p99_1m"))
    for route in INFERENCE_ROUTES:
        k = (*pod, ("route", route))
        assert 0 < p50[k] <= p99[k] < 60, (route, p50, p99)
    (queue,) = p.series("namespace_pod:egemma_queue_us_per_request:rate1m")
    assert tuple(labelled([queue])) == (pod,) and value(queue) >= 0
    (errors,) = p.series("namespace:egemma_http_errors:ratio_rate5m")
    assert value(errors) == 0  # every refusal sent is a 4xx
    assert {r["metric"]["route"] for r in p.series("namespace_route:egemma_request_duration_seconds:p99_5m")} >= set(
        INFERENCE_ROUTES)


def test_alerts_on_the_live_data(scraped):
    """Each alert's expression, on a healthy server that the stand-in watchdog says restarted once."""
    p, _, _ = scraped
    rules = _rules()
    assert p.query(rules["EmbeddingGemmaHighErrorRatio"]["expr"]) == []
    assert p.query(rules["EmbeddingGemmaNoReadyPod"]["expr"]) == []
    assert all(value(r) > 1 for r in p.query(rules["EmbeddingGemmaP99LatencyHigh"]["expr"]))
    (restart,) = p.query(rules["EmbeddingGemmaWatchdogRestarts"]["expr"])
    assert restart["metric"]["pod"] == POD and value(restart) > 0
    assert p.query(rules["EmbeddingGemmaGPUMemoryNearFull"]["expr"]) == []  # no GPU full (or none at all)


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(panel["title"], t["expr"]) for panel in dash["panels"] for t in panel["targets"]]


def test_every_dashboard_panel_has_data(scraped):
    p, _, _ = scraped
    gpu = bool(p.query("nv_gpu_memory_total_bytes"))
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    for title, expr in exprs:
        filled = (expr.replace("$__rate_interval", "1m").replace("$namespace", NS).replace("$pod", ".+"))
        if not gpu and any(m in expr for m in CPU_EMPTY):
            assert p.query(filled) == [], (title, filled)
            continue
        p.series(filled, timeout=30)


def test_the_hpa_metric_as_prometheus_adapter_queries_it(scraped):
    """The adapter's seriesQuery finds the pod's series, and its metricsQuery, filled as the adapter fills it for
    the HPA (GroupBy pod, LabelMatchers of the namespace and pods), gives the pod's queue time per request: the
    recorded series (namespace_pod:egemma_queue_us_per_request:rate1m) is the same expression."""
    p, _, _ = scraped
    (rule,) = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]
    found = p.series(rule["seriesQuery"])
    assert {(r["metric"]["namespace"], r["metric"]["pod"]) for r in found} == {(NS, POD)}
    q = (rule["metricsQuery"].replace("<<.GroupBy>>", "pod")
         .replace("<<.LabelMatchers>>", f'namespace="{NS}",pod=~"{POD}"'))
    (got,) = p.series(q)
    assert got["metric"] == {"pod": POD} and value(got) >= 0
    recorded = _rules()["namespace_pod:egemma_queue_us_per_request:rate1m"]["expr"]
    assert " ".join(recorded.split()) == " ".join(
        rule["metricsQuery"].replace("<<.GroupBy>>", "namespace, pod").replace("<<.LabelMatchers>>,", "").split())


def test_metrics_are_typed_and_carry_no_user_text(scraped):
    p, gw, _ = scraped
    text = requests.get(f"{gw.url}/metrics", timeout=10).text
    assert SECRET not in text
    out = subprocess.run([binary("promtool"), "check", "metrics"], input="".join(
        line + "\n" for line in text.splitlines() if line.startswith(("egemma_", "# HELP egemma_", "# TYPE egemma_"))),
        capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # the model instances' histograms (the stubs' files) and the gateway's, summed over its two workers
    for name in ("egemma_batch_size", "egemma_batch_tokens", "egemma_tokenize_duration_seconds",
                 "egemma_engine_duration_seconds", "egemma_request_duration_seconds"):
        assert f"# TYPE {name} histogram" in text and value(p.series(f"sum({name}_count) > 0")[0]) > 0
    # the model instances' counters: none repeats a histogram's _sum / _count or Triton's own counts
    assert value(p.series("sum(egemma_encoder_seconds_total) > 0")[0]) > 0
    assert value(p.series("sum(egemma_graph_replays_total) + sum(egemma_eager_runs_total) > 0")[0]) > 0
    reasons = {r["metric"]["reason"] for r in p.series("egemma_requests_refused_total")}
    assert {"too_large", "not_found", "validation"} <= reasons, reasons
    codes = {r["metric"]["code"] for r in p.series("egemma_requests_total")}
    assert {"200", "404", "413", "422"} <= codes, codes
