"""The layout's promises, enforced: imports point one way, the checker installs under the project's own name, and
benchmarks/ stays a tool of the checkout.

Every import statement is read with ast (top level and inside functions) in gpt2_port/, checks/, benchmarks/ and
scripts/. The layer table below is the one place the order lives: it names gpt2_port's folders, so a file in a folder
it does not know, or one that imports up the table or across into a sibling, fails the test.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# gpt2_port's folders, bottom first: a module imports only modules of its own folder (no circles) or of a folder
# below it, never a sibling on its own layer, never one above, not even inside a function. The top files are the
# leaves every folder may use; the package's __init__ (the public API) and __main__ sit above the library, the CLI
# above all. A file in a folder or at the top that this table does not know fails the test: a newcomer learns here
# where a new thing goes.
TOP_FILES = {"errors", "config", "devices", "gpu_kernel", "cpu", "files", "plots"}
LAYERS: list[tuple[str, set[str]]] = [
    ("top files", {f"top.{m}" for m in TOP_FILES}),
    ("io", {"io"}),  # files in and out: never the model (it reads and writes state dicts)
    ("generate", {"generate"}),  # written against the model's interface (generate/protocol.py), as GenerationMixin
    ("model", {"model"}),
    ("uses", {"train", "eval"}),  # siblings: neither imports the other
    ("package", {"__init__"}),  # the public API: from gpt2_port import GPT2, GPT2Config
    ("cli", {"cli"}),
    ("entry", {"__main__"}),  # python -m gpt2_port (torchrun runs it)
]
LAYER_OF = {room: k for k, (_, rooms) in enumerate(LAYERS) for room in rooms}

# The one sanctioned upward edge: these commands call into the checker.
MAY_IMPORT_CHECKS = {
    "gpt2_port.cli.parity",
    "gpt2_port.cli.parity_backward",
    "gpt2_port.cli.parity_io",
    "gpt2_port.cli.attention",
    "gpt2_port.cli.eval",
}

# checks/ (installed as gpt2_port_checks): the base never imports the top.
CHECKS_BASE = {"__init__", "metrics", "tolerances", "noise", "prompts", "reference", "points", "results", "storage"}
CHECKS_BASE |= {"grads", "steps", "backward_results"}
CHECKS_TOP = {"forward", "backward", "backward_report", "render", "plots", "attention_maps", "evaluation"}

CHECKS_PKG = "gpt2_port_checks"
SCANNED = {"gpt2_port": "gpt2_port", "checks": CHECKS_PKG, "benchmarks": "benchmarks", "scripts": "scripts"}


def module_name(path: Path) -> str:
    """gpt2_port/cli/parity.py -> gpt2_port.cli.parity; checks/x.py -> gpt2_port_checks.x."""
    rel = path.relative_to(REPO).with_suffix("")
    parts = [SCANNED[rel.parts[0]], *rel.parts[1:]]
    return ".".join(parts)


@functools.cache  # every planted-import case scans the whole tree again: each file is parsed once a process
def imports(name: str, source: str, is_package: bool = False) -> tuple[tuple[str, int, bool], ...]:
    """(absolute module imported, line, inside a function) for every import in `source`, wherever it sits.
    `from pkg import x` counts as `pkg.x` (the submodule or a name in pkg: both run pkg)."""
    pkg = name if is_package else name.rpartition(".")[0]
    out = []

    def visit(node: ast.AST, lazy: bool) -> None:  # one walk of the tree, knowing whether a function holds the node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                out.extend((f"{mod}.{a.name}" if a.name != "*" else mod, child.lineno, lazy) for a in child.names)
            visit(child, lazy or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(source), False)
    return tuple(out)


@functools.cache
def edits_sys_path(source: str) -> tuple[int, ...]:
    """Lines that touch sys.path (or site.addsitedir): any use, read or write, is flagged."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in (("sys", "path"), ("site", "addsitedir")):
                lines.append(node.lineno)
    return tuple(lines)


def room_of(module: str, known: set[str]) -> str | None:
    """gpt2_port.io.load -> io; gpt2_port.config -> top.config; gpt2_port (itself) -> __init__; None outside the
    package; "?name" for a module no folder or top file of the table holds."""
    parts = module.split(".")
    if parts[0] != "gpt2_port":
        return None
    if len(parts) == 1:
        return "__init__"
    if parts[1] == "__main__":
        return "__main__"
    if parts[1] in TOP_FILES:
        return f"top.{parts[1]}"
    if parts[1] in LAYER_OF:
        return parts[1]
    if len(parts) == 2 and module not in known:
        return "__init__"  # a name the package's __init__ defines (from gpt2_port import GPT2)
    return f"?{parts[1]}"


def resolve(target: str, known: set[str]) -> str:
    """The module an import runs: the longest known module that prefixes `target` (a module or a name in one)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return target


def violations(files: dict[str, str], packages: Iterable[str] = ()) -> list[str]:
    """Every broken rule in `files` (module name -> source); `packages` names the modules that are __init__ files."""
    packages = set(packages)
    known = set(files)
    bad: list[str] = []
    graph: dict[str, set[str]] = {}
    for name, source in sorted(files.items()):
        area = name.split(".")[0]
        short = name.split(".")[1] if "." in name else "__init__"
        room = room_of(name, known) if area == "gpt2_port" else None
        if room is not None and room not in LAYER_OF:
            where = "a top-level file" if name.count(".") == 1 else "a folder"
            bad.append(
                f"{name}: {where} the layer table does not know; put it in one of gpt2_port's folders "
                f"({', '.join(sorted(r for r in LAYER_OF if '.' not in r and not r.startswith('__')))}) or add "
                "it to TOP_FILES / LAYERS in tests/test_layout.py"
            )
            continue
        if area == CHECKS_PKG and short not in CHECKS_BASE | CHECKS_TOP:
            bad.append(
                f"{name}: not in the checks table; add {short!r} to CHECKS_BASE or CHECKS_TOP in tests/test_layout.py"
            )
            continue
        if area in ("gpt2_port", CHECKS_PKG) and (lines := edits_sys_path(source)):
            bad.append(f"{name}: sys.path used at line {lines[0]} (import through the installed packages instead)")
        for target, line, _lazy in imports(name, source, name in packages):
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
            if top == "benchmarks" and area == "benchmarks":
                graph.setdefault(name, set()).add(resolve(target, known))
            if top != "gpt2_port":
                continue
            mod = resolve(target, known)
            to = room_of(mod, known)
            if area != "gpt2_port":
                if to in ("cli", "__main__"):
                    bad.append(f"{where}: only the CLI itself reaches gpt2_port's cli")
                continue
            if to not in LAYER_OF:
                bad.append(f"{where}: {mod} is in no folder of the layer table (tests/test_layout.py)")
                continue
            up, same = LAYER_OF[to] > LAYER_OF[room], LAYER_OF[to] == LAYER_OF[room] and to != room
            if up or (same and not room.startswith("top.")):
                how = "up into" if up else "across into its sibling"
                bad.append(
                    f"{where}: {room} ({LAYERS[LAYER_OF[room]][0]}) imports {how} {to} ({LAYERS[LAYER_OF[to]][0]})"
                )
            if mod != name:
                graph.setdefault(name, set()).add(mod)
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
    assert "gpt2_port.cli.parity" in files and f"{CHECKS_PKG}.forward" in files and "benchmarks.bench" in files
    assert violations(files, packages) == []


def test_every_folder_of_the_package_is_in_the_layer_table():
    """The table and the tree agree: each folder of gpt2_port/ is a room of the table and each room exists."""
    on_disk = {p.parent.name for p in (REPO / "gpt2_port").glob("*/__init__.py")}
    rooms = {r for r in LAYER_OF if "." not in r and not r.startswith("__")}
    assert on_disk == rooms
    assert {p.stem for p in (REPO / "gpt2_port").glob("*.py")} == TOP_FILES | {"__init__", "__main__"}


@pytest.mark.parametrize(
    ("name", "source", "expect"),
    [
        (
            "gpt2_port.config",
            "def f():\n    from .io.load import read_state\n",
            "top.config (top files) imports up into io",
        ),
        ("gpt2_port.io.load", "def f():\n    from ..model import GPT2\n", "io (io) imports up into model"),
        ("gpt2_port.generate.loop", "from gpt2_port.model.modules import wants_grad\n", "imports up into model"),
        ("gpt2_port.model.gpt2", "def f():\n    from ..train import Trainer\n", "imports up into train"),
        ("gpt2_port.train.loop", "from ..eval.score import Scorer\n", "across into its sibling eval"),
        ("gpt2_port.eval.score", "def f():\n    from gpt2_port.train.data import TokenFile\n", "sibling train"),
        ("gpt2_port.model.gpt2", "from gpt2_port import GPT2\n", "imports up into __init__"),
        ("gpt2_port.io.load", "import transformers\n", "only checks/, benchmarks/ and tests import transformers"),
        ("gpt2_port.cli.generate", "from gpt2_port_checks import render\n", "may call into the checker"),
        ("gpt2_port.cli.parity", "import benchmarks.bench\n", "tool of the checkout"),
        ("gpt2_port_checks.metrics", "from .forward import run_detailed\n", "base (metrics) imports its top"),
        ("gpt2_port_checks.forward", "from gpt2_port.cli import main\n", "only the CLI itself"),
        ("gpt2_port_checks.plots", "from checks.results import Sweep\n", "import it by that name"),
        ("gpt2_port_checks.render", "import sys\nsys.path.insert(0, '.')\n", "sys.path used"),
        ("gpt2_port.newthing", "import torch\n", "gpt2_port.newthing: a top-level file the layer table does not know"),
        (
            "gpt2_port.kernels.flash",
            "import torch\n",
            "gpt2_port.kernels.flash: a folder the layer table does not know",
        ),
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


def test_a_circle_in_the_benchmarks_is_caught():
    files, packages = repo_sources()
    files["benchmarks.bench"] += "\ndef f():\n    from benchmarks.__main__ import main\n"
    assert any(v.startswith("import circle:") and "benchmarks.bench" in v for v in violations(files, packages))


def test_a_circle_inside_a_folder_is_caught():
    files, packages = repo_sources()
    files["gpt2_port.io.adapter"] += "\nfrom . import tokenizer\n"
    files["gpt2_port.io.tokenizer"] += "\ndef f():\n    from .adapter import hf_shapes\n"
    assert any(v.startswith("import circle:") and "gpt2_port.io.adapter" in v for v in violations(files, packages))


def test_the_model_offers_from_pretrained_save_pretrained_and_generate_without_importing_their_users():
    """GPT2 keeps transformers' spelling of the three, yet io/ and generate/ never import the model: the edges
    model -> io and model -> generate are the only ones, so no circle hides behind the convenience methods."""
    files, packages = repo_sources()
    from gpt2_port import GPT2

    assert all(callable(getattr(GPT2, m)) for m in ("from_pretrained", "save_pretrained", "generate"))
    for name, source in files.items():
        if name.startswith(("gpt2_port.io", "gpt2_port.generate")):
            assert not [t for t, _, _ in imports(name, source, name in packages) if t.startswith("gpt2_port.model")]


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


def _setuptools_version() -> tuple[int, int]:
    from gpt2_port.model.fused import minor_version

    try:
        return minor_version(importlib.metadata.version("setuptools"))
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)


def test_wheel_installs_no_generic_checks_package(tmp_path: Path):
    """A plain wheel holds gpt2_port and gpt2_port_checks (the checks/ directory) and nothing else at the top."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        (src / name).write_bytes((REPO / name).read_bytes())
    for d in ("gpt2_port", "checks"):
        for p in (REPO / d).rglob("*"):
            if not p.is_file() or "__pycache__" in p.parts:
                continue
            dst = src / p.relative_to(REPO)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(p.read_bytes())
    # Without build isolation when a setuptools that builds wheels itself (70.1 on) is at hand (fast, offline); else
    # pip fetches the build backend.
    isolation = ["--no-build-isolation"] if _setuptools_version() >= (70, 1) else []
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
    assert "gpt2_port/cli/parity.py" in names and "gpt2_port/cli/bench.py" not in names
    assert "gpt2_port/io/gpt2_bpe/encoder.json" in names


def test_the_cli_has_no_bench_command():
    """The benchmark runs from the checkout (`python -m benchmarks`), not through the installed command."""
    from gpt2_port.cli.main import COMMAND_MODULES

    assert not any(m.endswith(".bench") for m in COMMAND_MODULES)
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert r.returncode == 0 and "--sizes" in r.stdout and "python -m benchmarks" in r.stdout
