"""The documentation holds: every code block of README.md and docs/api.md runs against the server scripts/serve.sh
starts on a fresh clone (no model given, no hub: the demo checkpoint) and prints what the `output` block under it
says; the configuration table lists exactly the launcher's and the gateway's flags; the module map lists exactly
egemma's modules; README.md stays an entry page. The same start is the quiet CPU start's test.

Blocks: a ```bash or ```python block is run (bash -c / python -c, ports rewritten to the test server's) and its
stdout compared with the ```output block right under it, `...` standing for anything. A comment
`<!-- docs-test: real checkpoint -->` above a block runs it against a server on $EMBEDDINGGEMMA_PATH; any other
`<!-- docs-test: why -->` says why the block is not run here (README.md's commands only)."""
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import ROOT

RUN = (ROOT / "README.md", ROOT / "docs" / "api.md")
REAL = "real checkpoint"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
MARK = re.compile(r"<!-- docs-test: (.*?) -->\s*$")
PORTS = re.compile(r"\b(localhost|127\.0\.0\.1):(800[012])\b")


@dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    mark: str | None = None
    output: str | None = None
    end: int = 0  # where its fence closes in the file

    def __str__(self):
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The bash / python blocks of a Markdown file, each with its docs-test mark and the output block under it."""
    text, out = path.read_text(), []
    for m in FENCE.finditer(text):
        before = text[:m.start()]
        if m.group(1) == "output":
            prev = out[-1] if out else None
            assert prev and prev.output is None and not text[prev.end:m.start()].strip(), \
                f"{path.name}:{before.count(chr(10)) + 1}: an output block right under a code block only"
            prev.output = m.group(2)
            continue
        mark = MARK.search(before.rstrip("\n").rsplit("\n", 1)[-1] + "\n")
        out.append(Block(path, before.count("\n") + 1, m.group(1), m.group(2), mark and mark.group(1), end=m.end()))
    return out


def matches(want: str, got: str) -> bool:
    """want, with `...` for anything, against got; runs of whitespace compare equal."""
    parts = [re.escape(" ".join(p.split())) for p in want.split("...")]
    return re.fullmatch(r"\s*" + r".*?".join(parts) + r"\s*", " ".join(got.split()), re.S) is not None


ALL = [b for p in RUN for b in blocks(p)]


def test_every_block_is_checked():
    assert ALL
    for b in ALL:
        assert b.lang in ("bash", "python"), f"{b}: a ```{b.lang} block: bash, python or output only"
        if b.mark in (None, REAL):
            assert b.output is not None, f"{b}: no ```output block under it"
        else:
            assert b.path.name == "README.md", f"{b}: docs/api.md's blocks all run ({b.mark!r})"


def start(args: list[str], env: dict, log: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    """scripts/serve.sh as a user starts it, on free ports; returns (process, {8000: port, ...}) once ready."""
    from egemma.ops.tritonserver import free_port
    ports = {p: free_port() for p in (8000, 8001, 8002)}
    f = open(log, "w")
    p = subprocess.Popen([str(ROOT / "scripts/serve.sh"), "--http-port", str(ports[8000]), "--grpc-port",
                          str(ports[8001]), "--metrics-port", str(ports[8002]), "--run-dir", str(log.parent / "run"),
                          *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    text = ""
    while "\nready: " not in text:  # the launcher prints its banner once ready, or exits
        assert p.poll() is None, f"serve.sh exited {p.returncode}:\n{log.read_text()[-3000:]}"
        try:
            p.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
        text = log.read_text()
    return p, ports


def stop(p: subprocess.Popen):
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    """What `scripts/serve.sh` serves on a machine without the real checkpoint and without the hub."""
    d = tmp_path_factory.mktemp("docs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "EMBEDDINGGEMMA", "TRITON_INTERPRET"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(d / "hf"))
    p, ports = start([], env, d / "serve.log")
    yield ports, d / "serve.log"
    stop(p)


@pytest.fixture(scope="module")
def real_serve_sh(real_checkpoint, tmp_path_factory):
    """scripts/serve.sh --model $EMBEDDINGGEMMA_PATH."""
    d = tmp_path_factory.mktemp("docs-real")
    p, ports = start(["--model", str(real_checkpoint)], dict(os.environ), d / "serve.log")
    yield ports, d / "serve.log"
    stop(p)


def run_block(b: Block, ports: dict[int, int], cwd: Path):
    code = PORTS.sub(lambda m: f"{m.group(1)}:{ports[int(m.group(2))]}", b.code)
    cmd = ["bash", "-euo", "pipefail", "-c", code] if b.lang == "bash" else [sys.executable, "-c", code]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=env)
    assert r.returncode == 0, f"{b} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert matches(b.output, r.stdout), f"{b} printed\n{r.stdout[:800]}\nnot\n{b.output}"


@pytest.mark.parametrize("b", [b for b in ALL if b.mark is None], ids=str)
def test_block(b, default_server, tmp_path):
    run_block(b, default_server[0], tmp_path)


@pytest.mark.parametrize("b", [b for b in ALL if b.mark == REAL], ids=str)
def test_real_checkpoint_block(b, real_serve_sh, tmp_path):
    run_block(b, real_serve_sh[0], tmp_path)


def test_the_default_start_says_demo_and_is_quiet_on_cpu(default_server):
    """The demo says so (log and banner); without a GPU, none of the CUDA / NVML / DCGM / pinned-memory lines Triton
    logs when it probes for a GPU (egemma.ops.tritonserver.CPU_ARGS, CPU_NOISE)."""
    log = default_server[1].read_text()
    assert "DEMO checkpoint with RANDOM weights" in log and "\n  DEMO    random weights" in log
    assert "huggingface-cli download google/embeddinggemma-300m" in log
    if os.path.exists("/dev/nvidiactl"):
        return
    assert log.count("no GPU: serving on CPU") == 1
    for noise in ("CUDA driver", "CudaDriverHelper", "unable to create stream", "NVML", "DCGM",
                  "Unable to allocate pinned"):
        assert noise not in log, f"{noise!r} in the CPU start's log:\n" + "\n".join(
            line for line in log.splitlines() if noise in line)
    assert not re.search(r"^E\d{4} ", log, re.M), "an error line in the CPU start's log"


def test_readme_is_an_entry_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200 and len(text.encode()) <= 12 * 1024
    assert "___" not in text and "__-__" not in text, "a placeholder"
    for row in (line for line in text.splitlines() if line.startswith("|") and "---" not in line):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(cells), f"an empty cell in {row!r}"
    for link in re.findall(r"\]\(((?:docs|perf)/[^)#]+)", text):
        assert (ROOT / link).exists() or link in OTHERS, f"README links {link}, which does not exist"


OTHERS = {"docs/long-documents.md", "docs/limits.md", "docs/observability.md"}  # written in other branches


# --- docs/configuration.md against the parsers


def table(doc: str, heading: str) -> dict[str, list[str]]:
    """{first cell's `--flag` names...: the row's cells} of the table under `## heading`."""
    text = (ROOT / "docs" / doc).read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # not at \|
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name.split()[0]] = cells
    return rows


COMPUTED = {"--admin-key", "--cache-dir", "--gateway-workers", "--run-dir"}  # their default depends on the host


def check_parser(ap, rows: dict[str, list[str]]):
    flags = {s: a for a in ap._actions for s in a.option_strings if s not in ("-h", "--help")}
    assert set(flags) == set(rows), (f"flags without a row: {sorted(set(flags) - set(rows))}; "
                                     f"rows of no flag: {sorted(set(rows) - set(flags))}")
    for name, a in flags.items():
        default = rows[name][1]
        if name in COMPUTED or a.default is None or isinstance(a.default, (bool, list)):
            continue
        want = str(int(a.default) if isinstance(a.default, float) and a.default.is_integer() else a.default)
        assert want in default.replace(",", ""), f"{name}: default {a.default}, the table says {default}"


def test_configuration_lists_every_launcher_flag():
    from egemma.ops.launcher import parser
    check_parser(parser(), table("configuration.md", "scripts/serve.sh, egemma-serve"))


def test_configuration_lists_every_gateway_flag():
    from egemma.gateway.app import parser
    check_parser(parser(), table("configuration.md", "The gateway"))


def test_configuration_lists_every_environment_variable():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", doc.split("\n## Environment variables\n", 1)[1], re.M))
    code, rest = (sources(("egemma", "scripts")), sources(("tests", "perf", "deploy")))
    used = set(re.findall(r"\b((?:EGEMMA|TRITON|HF|EMBEDDINGGEMMA)_[A-Z0-9_]+)\b", code))
    used -= {"TRITON_INTERPRET"}  # the tests' (tests/conftest.py), not the server's
    assert used <= documented, f"read by the code, not in the table: {sorted(used - documented)}"
    assert {v for v in documented if v not in code + rest} == set(), "documented, read nowhere"


def sources(dirs) -> str:
    return "".join(p.read_text(errors="replace") for d in dirs for p in (ROOT / d).rglob("*")
                   if p.is_file() and (p.suffix in (".py", ".sh", ".yaml") or p.name == "Dockerfile"))


# --- docs/design.md's module map against the tree


def test_module_map_matches_the_tree():
    doc = (ROOT / "docs" / "design.md").read_text()
    section = doc.split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    mapped = set(re.findall(r"^\| `(egemma/[\w/]+\.(?:py|c))`", section, re.M))
    tree = {str(p.relative_to(ROOT)) for p in (ROOT / "egemma").rglob("*")
            if p.suffix in (".py", ".c") and p.name != "__init__.py"}
    assert mapped == tree, f"in the tree, not the map: {sorted(tree - mapped)}; in the map, not the tree: " \
                           f"{sorted(mapped - tree)}"


def test_configuration_lists_every_model_parameter():
    declared = {k for c in (ROOT / "model_repository").glob("*/config.pbtxt")
                for k in re.findall(r'parameters \{ key: "(\w+)"', c.read_text())}
    assert set(table("configuration.md", "Model parameters")) == declared


def test_configuration_gives_each_model_parameter_the_default_its_reader_defines():
    """The configs leave every parameter empty (tests/test_placement.py): the default is the one its reader
    defines, and the table says that one."""
    from dataclasses import fields

    from egemma.engine.config import EngineConfig
    from egemma.engine.tokenizer import DEFAULT_BACKEND
    from egemma.spec import MAX_TEXT_BYTES
    from egemma.stub import budget
    rows = table("configuration.md", "Model parameters")
    defaults = {f.name: f.default for f in fields(EngineConfig) if f.name in rows and f.name != "checkpoint"}
    defaults |= {"tokenizer_backend": DEFAULT_BACKEND, "max_text_bytes": MAX_TEXT_BYTES,
                 budget.PARAMETER: budget.DEFAULT}
    for name, default in defaults.items():
        said = rows[name][2]
        assert str(default).lower() in said.replace(",", ""), f"{name}: default {default}, the table says {said}"


@pytest.mark.parametrize("command, name", [("scripts/serve.sh", "scripts/serve.sh"),
                                           (str(Path(sys.executable).with_name("egemma-serve")), "egemma-serve")])
def test_help_speaks_as_the_command_typed_in_groups(command, name):
    r = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "EGEMMA_PROG"})
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {name} "), (r.stdout[:200], r.stderr)
    for group in ("model:", "network:", "gateway (HTTP):", "security:", "lifecycle:"):
        assert f"\n{group}\n" in r.stdout, group
    assert "docs/configuration.md" in r.stdout
