"""A real Prometheus for the observability tests: Debian's `prometheus` package (2.42, with promtool), which
scripts/setup.sh installs as root under CI; a skip without it elsewhere, a failure under CI=true (as kubectl). The
rules shipped in deploy/ as a plain rules file, a Prometheus scraping given targets every second, and its query API."""
import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, wait_for

RULES = ROOT / "deploy" / "k8s" / "prometheusrule.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "embeddinggemma.json"
ADAPTER = ROOT / "deploy" / "k8s" / "prometheus-adapter" / "values.yaml"


def binary(name: str) -> str:
    """prometheus or promtool from PATH."""
    exe = shutil.which(name)
    if exe is None:
        why = f"{name} is not installed: scripts/setup.sh installs Debian's prometheus package as root (apt-get)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return exe


def rules_file(d: Path) -> Path:
    """The PrometheusRule's groups as a rules file Prometheus and promtool read."""
    spec = yaml.safe_load(RULES.read_text())["spec"]
    path = d / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": spec["groups"]}, sort_keys=False))
    return path


class Prometheus:
    """A prometheus process scraping targets [(host:port, {label: value})] at /metrics every second, with rules."""

    def __init__(self, d: Path, targets: list[tuple[str, dict]], rules: Path):
        from egemma.ops.tritonserver import free_port
        self.port = free_port()
        cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
               "scrape_configs": [{"job_name": "embeddinggemma", "metrics_path": "/metrics",
                                   "static_configs": [{"targets": [t], "labels": labels} for t, labels in targets]}]}
        (d / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        self.log = open(d / "prometheus.log", "w")
        self.proc = subprocess.Popen([binary("prometheus"), f"--config.file={d / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={d / 'data'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 60, "prometheus ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited (see prometheus.log)"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar as one sample) expr evaluates to now; an invalid expression fails."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                out = json.load(r)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{expr}: {e.read().decode()}") from None
        assert out["status"] == "success", (expr, out)
        data = out["data"]
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def series(self, expr: str, timeout: float = 90) -> list[dict]:
        """query(expr) once it returns a series (the data it needs has been scraped and recorded)."""
        res = []

        def some():
            res[:] = self.query(expr)
            return bool(res)
        wait_for(some, timeout, f"a series from {expr}")
        return res

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def value(sample: dict) -> float:
    return float(sample["value"][1])


def labelled(results: list[dict]) -> dict[tuple, float]:
    """{sorted label pairs but the name: value} of a query's results."""
    return {tuple(sorted((k, v) for k, v in r["metric"].items() if k != "__name__")): value(r) for r in results}
