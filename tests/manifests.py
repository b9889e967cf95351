"""What the deploy tests share: deploy/'s manifests rendered offline (`kubectl kustomize`), their objects by kind,
the Deployment's container and its full command line (the Dockerfile's ENTRYPOINT and the manifest's args), and
the prometheus-adapter rule the autoscaler reads."""
import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import ROOT

DEPLOY = ROOT / "deploy"


def kustomize(path: Path) -> list[dict]:
    """The objects `kubectl kustomize path` renders. Without kubectl: a skip, but a failure under CI (CI=true),
    where scripts/setup.sh installs it: the manifests must not go untested there."""
    if not shutil.which("kubectl"):
        why = "kubectl (kustomize) is not installed: scripts/setup.sh installs Debian's kubernetes-client as root"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@functools.cache
def rendered(name: str) -> dict[str, dict]:
    """deploy/<name> rendered, {kind: object} (one object of each kind)."""
    out = {}
    for o in kustomize(DEPLOY / name):
        assert o["kind"] not in out, f"two {o['kind']} objects"
        out[o["kind"]] = o
    return out


def container(k8s) -> dict:
    (c,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def entrypoint() -> list[str]:
    """deploy/Dockerfile's ENTRYPOINT (exec form)."""
    (entry,) = re.findall(r"^ENTRYPOINT (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M)
    return json.loads(entry)


def container_argv(args: list[str]) -> list[str]:
    """The container's command: the ENTRYPOINT with a manifest's args (which replace the image's CMD)."""
    return [*entrypoint(), *args]


def option(argv: list[str], name: str) -> str:
    """The value argparse takes for `name`: its last occurrence."""
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]


def adapter_rule() -> dict:
    (rule,) = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
    return rule
