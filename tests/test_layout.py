"""The layout rules, read from the source: the tiers' import directions (engine -> nothing of stub, gateway or ops;
stub -> nothing of gateway or ops; gateway -> nothing of ops; kernels -> none of the four, the engine included: the
engine chooses among its kernels, never the other way; client -> none of the others but the spec, and no torch;
spec, the vocabulary every tier shares -> none of them, and no torch), no symbolic links
in the package, no top-level `kernels` module anywhere, every file opening with a docstring, source files (perf/ too)
within ~400 lines unless they say why, and pyproject's package list."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

FORBIDDEN = {"egemma.engine": ("egemma.stub", "egemma.gateway", "egemma.ops"),
             "egemma.stub": ("egemma.gateway", "egemma.ops"), "egemma.gateway": ("egemma.ops",),
             "egemma.kernels": ("egemma.engine", "egemma.stub", "egemma.gateway", "egemma.ops"),
             # egemma-embed runs wherever the corpus is: tritonclient, pyarrow and tqdm, never torch
             "egemma.client": ("egemma.engine", "egemma.stub", "egemma.gateway", "egemma.ops", "egemma.kernels"),
             "egemma.spec": ("egemma.engine", "egemma.stub", "egemma.gateway", "egemma.ops", "egemma.kernels",
                             "egemma.client")}
MAX_LINES = 400  # files are cut by concept: past this a file holds two, or says why it is one
LONG_REASON = re.compile(r"\blong:\s*\S+(\s+\S+){2,}")  # "long:" and a reason of three words or more


def py_files(*dirs: str) -> list[Path]:
    """The .py files under ROOT/dir for each dir, without perf/results."""
    out = []
    for d in dirs:
        for base, subdirs, files in os.walk(ROOT / d):
            subdirs[:] = sorted(s for s in subdirs if s != "__pycache__" and Path(base, s) != ROOT / "perf" / "results")
            out += [Path(base) / f for f in sorted(files) if f.endswith(".py")]
    return out


def module_name(path: Path) -> str:
    """Dotted name of a file under egemma/ as imported (egemma/kernels/x.py is egemma.kernels.x)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, module: str = "") -> set[str]:
    """Every module name the file imports, at any depth (lazy imports in functions too): `import a.b` gives
    a.b, `from a import b` gives a and a.b (b may be a module), relative imports resolved against `module`,
    importlib.import_module / __import__ of a literal string included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                anchor = package.split(".")[:len(package.split(".")) - (n.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            out |= {base} | {f"{base}.{a.name}" for a in n.names}
        elif isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant) \
                and isinstance(n.args[0].value, str) and (
                    isinstance(n.func, ast.Attribute) and n.func.attr == "import_module"
                    or isinstance(n.func, ast.Name) and n.func.id in ("__import__", "import_module")):
            out.add(n.args[0].value)
    return out - {""}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_tiers_import_only_downwards():
    """Transitively: importing a module runs every module it imports and their packages' __init__, so a rule
    broken two hops away (or in a package __init__) counts."""
    modules = {module_name(p): p for p in py_files("egemma")}
    assert {"egemma.engine.engine", "egemma.stub.adapter", "egemma.ops.launcher", "egemma.kernels.triton_ops",
            "egemma.client.embed", "egemma.spec"} <= modules.keys(), sorted(modules)

    def runs(name: str) -> set[str]:  # the known modules that importing `name` executes: it and its parents
        parts = name.split(".")
        return {m for k in range(1, len(parts) + 1) if (m := ".".join(parts[:k])) in modules}
    edges = {m: set().union(*map(runs, imported(p, m))) for m, p in modules.items()}
    broken = []
    for m in modules:
        tier = next((t for t in FORBIDDEN if within(m, t)), None)
        if tier is None:
            continue
        seen, todo = {m: [m]}, [m]
        while todo:  # breadth first: the shortest chain to each module
            cur = todo.pop(0)
            for nxt in sorted(edges[cur] - seen.keys()):
                seen[nxt] = seen[cur] + [nxt]
                todo.append(nxt)
        broken += [" -> ".join(chain) for dep, chain in seen.items() if any(within(dep, f) for f in FORBIDDEN[tier])]
    assert not broken, "imports against the tiers:\n" + "\n".join(broken)


def test_no_symbolic_links_in_the_package():
    """A link hides an import edge from every tool that reads the tree (egemma/kernels once pointed to ../kernels)."""
    links = [str(Path(base, n).relative_to(ROOT)) for base, dirs, files in os.walk(ROOT / "egemma")
             for n in dirs + files if Path(base, n).is_symlink()]
    assert not links, links
    assert not (ROOT / "kernels").exists(), "the kernels live in egemma/kernels"


@pytest.mark.parametrize("module", ["egemma.client.embed", "egemma.spec"])
def test_the_corpus_client_and_the_spec_run_without_torch(module):
    """What importing egemma-embed, or the vocabulary every tier shares, loads (third-party imports too): no
    torch, transformers or tokenizers."""
    heavy = ("torch", "transformers", "tokenizers", "triton")
    code = f"import sys, {module}; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_top_level_kernels_module_is_imported():
    """`kernels` is Hugging Face's package that transformers probes for; ours is egemma.kernels."""
    files = py_files("egemma", "model_repository", "perf", "scripts", "tests")
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in sorted(imported(p))
           if within(name, "kernels")]
    assert not bad, bad
    assert within("kernels.select", "kernels") and not within("egemma.kernels.native", "kernels")


def test_every_file_opens_with_a_docstring():
    files = py_files("egemma", "model_repository", "scripts", "perf", "tests")
    assert len(files) > 30 and not any(ROOT / "perf" / "results" in p.parents for p in files)
    missing = []
    for p in files:
        doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")), clean=False)
        if not doc or not doc.split("\n")[0].strip():
            missing.append(str(p.relative_to(ROOT)))
    assert not missing, f"files that do not open with a one-line docstring saying what they are for: {missing}"


def over_long(source: str) -> bool:
    """Whether a file's source is over MAX_LINES lines without its docstring saying why ("long: reason")."""
    if len(source.splitlines()) <= MAX_LINES:
        return False
    doc = ast.get_docstring(ast.parse(source)) or ""
    return not LONG_REASON.search(doc)


def test_the_length_rule_itself():
    body = "x = 1\n" * MAX_LINES
    assert not over_long('"""Short."""\n' + "x = 1\n" * (MAX_LINES - 1))
    assert over_long('"""Short."""\n' + body)
    assert over_long('"""Grown. long:"""\n' + body)  # a reason must be given
    assert not over_long('"""Grown. long: one table per op, split it and you lose the overview."""\n' + body)
    assert over_long('"""Grown."""\n# long: a comment is not the docstring\n' + body)


def test_source_files_are_short_or_say_why():
    files = {p.resolve(): p for p in py_files("egemma", "model_repository", "perf")}
    assert ROOT / "egemma" / "kernels" / "triton_ops.py" in files and ROOT / "egemma" / "engine" / "engine.py" in files
    assert ROOT / "perf" / "serving" / "bench_serve.py" in files
    assert not any(ROOT / "perf" / "results" in p.parents for p in files)
    long = [f"{p.relative_to(ROOT)} ({len(p.read_text(encoding='utf-8').splitlines())} lines)"
            for p in files.values() if over_long(p.read_text(encoding="utf-8"))]
    assert not long, f"over {MAX_LINES} lines without 'long: <reason>' in the docstring: {long}"


def test_kernels_install_inside_egemma():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = cfg["packages"], cfg.get("package-dir", {})
    assert isinstance(packages, list), "an explicit package list: a find directive could pick up kernels/"
    assert not [p for p in [*packages, *dirs] if within(p, "kernels")], (packages, dirs)
    assert "egemma.kernels" in packages
    assert {p for p in packages if p.startswith("egemma.")} == {
        module_name(p.parent) for p in py_files("egemma") if p.name == "__init__.py"} - {"egemma"}


@pytest.mark.parametrize("source,module,want", [
    ("from . import native\nfrom .select import Ops\n", "egemma.kernels.x",
     {"egemma.kernels", "egemma.kernels.native", "egemma.kernels.select", "egemma.kernels.select.Ops"}),
    ("def f():\n    import kernels.native\n", "egemma.engine.x", {"kernels.native"}),
    ("import importlib\nimportlib.import_module('egemma.ops.launcher')\n", "egemma.stub.x",
     {"importlib", "egemma.ops.launcher"}),
    ("from ..ops import watchdog\n", "egemma.stub.x", {"egemma.ops", "egemma.ops.watchdog"}),
])
def test_imports_are_read_at_any_depth(tmp_path, source, module, want):
    f = tmp_path / "m.py"
    f.write_text(source)
    assert imported(f, module) == want
