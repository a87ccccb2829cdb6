"""The layout's promises, enforced: imports point one way, the checker installs under the project's own name, and
benchmarks/ stays a tool of the checkout.

Every import statement is read with ast (top level and inside functions) in gpt2_port/, checks/, benchmarks/ and
scripts/. The layer table below is the one place the order lives; a new gpt2_port module fails the test until it is
added to it.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# gpt2_port's layers, bottom first: a module imports only modules of its own layer or below (and no circles).
# Modules not written yet are listed too, so that they land in the right room.
LAYERS: list[tuple[str, set[str]]] = [
    ("leaves", {"errors", "config", "devices", "util"}),
    ("model pieces", {"taps", "kv_cache", "masks", "loss", "init", "c_attn", "fused"}),
    ("model", {"model", "__init__"}),  # the package itself re-exports config, errors and model
    ("files", {"adapter", "safetensors_io", "checkpoint", "hub", "tokenizer"}),
    ("load", {"load"}),
    (
        "uses",
        {"generate", "decode", "quantize", "demo", "prepare", "data", "train", "evaluate", "windows", "published"}
        | {"schedule", "memory", "trainer_state", "distributed"},
    ),
    ("top", {"cli", "__main__", "commands"}),  # commands: gpt2_port/commands/*
]
LAYER_OF = {mod: k for k, (_, mods) in enumerate(LAYERS) for mod in mods}

# Upward edges that exist today, allowed only inside a function (imported on call, so no circle at import time):
# GPT2's convenience methods that mirror transformers' API. Each names its reason; an entry no longer used fails
# the test, so the table only shrinks.
LAZY_UPWARD = {
    ("model", "load"): "GPT2.from_pretrained and GPT2.save_pretrained call load's functions",
    ("model", "generate"): "GPT2.generate calls generate.generate",
}

# The one sanctioned upward edge: these commands call into the checker.
MAY_IMPORT_CHECKS = {
    "gpt2_port.commands.parity",
    "gpt2_port.commands.parity_backward",
    "gpt2_port.commands.attention",
    "gpt2_port.commands.eval",
}

# checks/ (installed as gpt2_port_checks): the base never imports the top.
CHECKS_BASE = {"__init__", "metrics", "tolerances", "noise", "prompts", "reference", "points", "results"}
CHECKS_TOP = {"forward", "backward", "backward_report", "render", "plots", "attention_maps", "evaluation"}

CHECKS_PKG = "gpt2_port_checks"
SCANNED = {"gpt2_port": "gpt2_port", "checks": CHECKS_PKG, "benchmarks": "benchmarks", "scripts": "scripts"}


def module_name(path: Path) -> str:
    """gpt2_port/commands/parity.py -> gpt2_port.commands.parity; checks/x.py -> gpt2_port_checks.x."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = [SCANNED[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts)


def imports(name: str, source: str, is_package: bool = False) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, inside a function) for every import in `source`, wherever it sits.
    `from pkg import x` counts as `pkg.x` (the submodule or a name in pkg: both run pkg)."""
    pkg = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    in_function = {
        id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(f)
    }
    out = []
    for node in ast.walk(tree):
        lazy = id(node) in in_function
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno, lazy) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [(f"{mod}.{a.name}" if a.name != "*" else mod, node.lineno, lazy) for a in node.names]
    return out


def edits_sys_path(source: str) -> list[int]:
    """Lines that touch sys.path (or site.addsitedir): any use, read or write, is flagged."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in (("sys", "path"), ("site", "addsitedir")):
                lines.append(node.lineno)
    return lines


def gpt2_port_module(target: str, known: set[str]) -> str | None:
    """gpt2_port.load.from_pretrained -> load; gpt2_port.commands.x -> commands; gpt2_port (itself) -> __init__."""
    parts = target.split(".")
    if parts[0] != "gpt2_port":
        return None
    if len(parts) == 1 or parts[1] not in known:
        return "__init__"  # a name defined in the package's __init__
    return parts[1]


def violations(files: dict[str, str], packages: Iterable[str] = ()) -> list[str]:
    """Every broken rule in `files` (module name -> source); `packages` names the modules that are __init__ files."""
    packages = set(packages)
    known = {n.split(".")[1] for n in files if n.startswith("gpt2_port.") and n.count(".") >= 1}
    known |= set(LAYER_OF)
    bad: list[str] = []
    graph: dict[str, set[str]] = {}
    lazy_used: set[tuple[str, str]] = set()
    for name, source in sorted(files.items()):
        area = name.split(".")[0]
        short = name.split(".")[1] if "." in name else "__init__"
        if area == "gpt2_port" and short not in LAYER_OF:
            bad.append(
                f"{name}: not in the layer table; add {short!r} to LAYERS in tests/test_layout.py "
                "(in the layer whose modules it may import)"
            )
            continue
        if area == CHECKS_PKG and short not in CHECKS_BASE | CHECKS_TOP:
            bad.append(
                f"{name}: not in the checks table; add {short!r} to CHECKS_BASE or CHECKS_TOP in tests/test_layout.py"
            )
            continue
        if area in ("gpt2_port", CHECKS_PKG) and (lines := edits_sys_path(source)):
            bad.append(f"{name}: sys.path used at line {lines[0]} (import through the installed packages instead)")
        for target, line, lazy in imports(name, source, name in packages):
            top = target.split(".")[0]
            where = f"{name} line {line} imports {target}"
            if top == "transformers" and area not in (CHECKS_PKG, "benchmarks"):
                bad.append(f"{where}: only checks/, benchmarks/ and tests import transformers")
            if top == "benchmarks" and area != "benchmarks":
                bad.append(f"{where}: benchmarks/ is a tool of the checkout, imported by nothing in the package")
            if top == "checks":
                bad.append(f"{where}: the checker installs as {CHECKS_PKG}; import it by that name")
            if top == CHECKS_PKG and area == "gpt2_port" and name not in MAY_IMPORT_CHECKS:
                bad.append(f"{where}: only {', '.join(sorted(MAY_IMPORT_CHECKS))} may call into the checker")
            if top == CHECKS_PKG and area == CHECKS_PKG:
                t = target.split(".")[1] if target.count(".") else "__init__"
                if short in CHECKS_BASE and t in CHECKS_TOP:
                    bad.append(f"{where}: the checker's base ({short}) imports its top ({t})")
                graph.setdefault(name, set()).add(f"{CHECKS_PKG}.{t}")
            mod = gpt2_port_module(target, known)
            if mod is None:
                continue
            if area != "gpt2_port":
                if mod in ("cli", "__main__", "commands"):
                    bad.append(f"{where}: only the CLI itself reaches gpt2_port's cli and commands")
                continue
            if mod not in LAYER_OF:
                bad.append(f"{where}: {mod!r} is not in the layer table; add it to LAYERS in tests/test_layout.py")
                continue
            if LAYER_OF[mod] > LAYER_OF[short] and lazy and (short, mod) in LAZY_UPWARD:
                lazy_used.add((short, mod))
                continue
            if LAYER_OF[mod] > LAYER_OF[short]:
                bad.append(
                    f"{where}: {short} ({LAYERS[LAYER_OF[short]][0]}) imports up into "
                    f"{mod} ({LAYERS[LAYER_OF[mod]][0]})"
                )
            if mod != short and mod != "__init__":
                graph.setdefault(f"gpt2_port.{short}", set()).add(f"gpt2_port.{mod}")
    if "gpt2_port.model" in files:
        bad += [
            f"LAZY_UPWARD lists {e}, which no longer happens: remove it" for e in sorted(set(LAZY_UPWARD) - lazy_used)
        ]
    bad += [f"import circle: {' -> '.join(c)}" for c in cycles(graph)]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of more than one module (depth-first search)."""
    found, state = [], {}

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                found.append(stack[stack.index(m) :] + [m] if m in stack else [n, m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    return found


def repo_sources() -> tuple[dict[str, str], set[str]]:
    files, packages = {}, set()
    for top in SCANNED:
        for p in sorted((REPO / top).rglob("*.py")):
            name = module_name(p)
            if p.name == "__init__.py":
                name = name.removesuffix(".__init__")
                packages.add(name)
            files[name] = p.read_text(encoding="utf-8")
    return files, packages


def test_imports_point_down_the_layers():
    files, packages = repo_sources()
    assert "gpt2_port.commands.parity" in files and f"{CHECKS_PKG}.forward" in files and "benchmarks.bench" in files
    assert violations(files, packages) == []


@pytest.mark.parametrize(
    ("name", "source", "expect"),
    [
        ("gpt2_port.config", "def f():\n    from .load import locate\n", "config (leaves) imports up into load"),
        ("gpt2_port.model", "from gpt2_port.generate import generate\n", "imports up into generate"),
        ("gpt2_port.model", "def f():\n    from .quantize import quantize_int8\n", "imports up into quantize"),
        (
            "gpt2_port.model",
            "def f():\n    from .load import from_pretrained\n",
            "LAZY_UPWARD lists ('model', 'generate')",
        ),
        ("gpt2_port.load", "import transformers\n", "only checks/, benchmarks/ and tests import transformers"),
        ("gpt2_port.commands.generate", "from gpt2_port_checks import render\n", "may call into the checker"),
        ("gpt2_port.commands.parity", "import benchmarks.bench\n", "tool of the checkout"),
        ("gpt2_port_checks.metrics", "from .forward import run_detailed\n", "base (metrics) imports its top"),
        ("gpt2_port_checks.forward", "from gpt2_port.cli import main\n", "only the CLI itself"),
        ("gpt2_port_checks.plots", "from checks.results import Sweep\n", "import it by that name"),
        ("gpt2_port_checks.render", "import sys\nsys.path.insert(0, '.')\n", "sys.path used"),
        ("gpt2_port.newthing", "import torch\n", "add 'newthing' to LAYERS"),
        ("gpt2_port_checks.newrunner", "", "add 'newrunner' to CHECKS_BASE or CHECKS_TOP"),
        ("scripts.tool", "from transformers import GPT2LMHeadModel\n", "only checks/, benchmarks/ and tests"),
    ],
)
def test_a_planted_wrong_import_is_caught(name: str, source: str, expect: str):
    """The real tree with one module replaced (or added) by a wrong one: the scan names it."""
    files, packages = repo_sources()
    files[name] = source
    found = violations(files, packages)
    assert any(expect in v for v in found), found


def test_a_circle_inside_a_layer_is_caught():
    files, packages = repo_sources()
    files["gpt2_port.adapter"] += "\nfrom . import tokenizer\n"
    files["gpt2_port.tokenizer"] += "\ndef f():\n    from .adapter import hf_shapes\n"
    assert any(v.startswith("import circle:") and "gpt2_port.adapter" in v for v in violations(files, packages))


def test_pyproject_packages_cover_the_tree_and_map_checks():
    """The wheel's package list names every package directory, and checks/ installs as gpt2_port_checks."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == {CHECKS_PKG: "checks"}
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "gpt2_port").rglob("__init__.py")} | {
        CHECKS_PKG
    }
    assert set(conf["packages"]) == on_disk
    assert not any(p.split(".")[0] in ("checks", "benchmarks", "tests", "scripts") for p in conf["packages"])
    assert "." in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["pythonpath"]


def test_wheel_installs_no_generic_checks_package(tmp_path: Path):
    """A plain wheel holds gpt2_port and gpt2_port_checks (the checks/ directory) and nothing else at the top."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((REPO / name).read_bytes())
    for d in ("gpt2_port", "checks"):
        for p in (REPO / d).rglob("*.py"):
            dst = src / p.relative_to(REPO)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(p.read_bytes())
    # Without build isolation when setuptools is at hand (fast, offline); else pip fetches the build backend.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation, "-q", "-w", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = tmp_path.glob("gpt2_port-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"gpt2_port", CHECKS_PKG, next(t for t in tops if t.endswith(".dist-info"))}
    assert f"{CHECKS_PKG}/forward.py" in names and f"{CHECKS_PKG}/metrics.py" in names
    assert "gpt2_port/commands/parity.py" in names and "gpt2_port/commands/bench.py" not in names


def test_the_cli_has_no_bench_command():
    """The benchmark runs from the checkout (`python -m benchmarks`), not through the installed command."""
    from gpt2_port.cli import COMMAND_MODULES

    assert not any(m.endswith(".bench") for m in COMMAND_MODULES)
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0 and "--sizes" in r.stdout and "python -m benchmarks" in r.stdout
