"""./dev, the README's two commands: run here with stand-ins for .venv's python and ruff (an installed .venv is
pretended by its stamp) and for $PYTHON (which makes .venv-floor), so what the script does with their exit codes, and
what it runs in which venv, is checked without installing anything."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _fake_checkout(tmp_path: Path, ruff_check: int, ruff_format: int, pytest_rc: int) -> Path:
    root = tmp_path / "main"
    root.mkdir()
    for name in ("dev", "pyproject.toml"):
        shutil.copy2(REPO / name, root / name)
    bin_ = root / ".venv" / "bin"
    bin_.mkdir(parents=True)
    log = root / "calls.log"
    (bin_ / "python").write_text(f'#!/bin/sh\necho "python $*" >> {log}\nexit {pytest_rc}\n')
    (bin_ / "ruff").write_text(
        f'#!/bin/sh\necho "ruff $*" >> {log}\n[ "$1" = check ] && exit {ruff_check}\nexit {ruff_format}\n'
    )
    for f in bin_.iterdir():
        f.chmod(0o755)
    spec = "torch==2.13.0"  # ./dev's default TORCH_SPEC; the stamp says .venv holds it and this pyproject
    digest = hashlib.sha256((root / "pyproject.toml").read_bytes()).hexdigest()[:16]
    (root / ".venv" / ".gpt2port-installed").write_text(f"{digest} {spec}\n")
    return root


@pytest.mark.parametrize("ruff_check, ruff_format", [(1, 0), (0, 1)])
def test_a_lint_failure_fails_the_test_command_before_pytest(tmp_path: Path, ruff_check: int, ruff_format: int) -> None:
    root = _fake_checkout(tmp_path, ruff_check, ruff_format, pytest_rc=0)
    env = dict(os.environ, TORCH_SPEC="torch==2.13.0")
    r = subprocess.run(
        ["bash", str(root / "dev"), "test", "-k", "x"], cwd=root, env=env, capture_output=True, text=True
    )
    calls = (root / "calls.log").read_text()
    assert r.returncode != 0, calls
    assert "-m pytest" not in calls  # the suite never ran on unlinted code


def test_a_clean_lint_runs_the_suite_and_returns_its_code(tmp_path: Path) -> None:
    root = _fake_checkout(tmp_path, 0, 0, pytest_rc=3)
    env = dict(os.environ, TORCH_SPEC="torch==2.13.0")
    r = subprocess.run(
        ["bash", str(root / "dev"), "test", "-k", "x"], cwd=root, env=env, capture_output=True, text=True
    )
    calls = (root / "calls.log").read_text().splitlines()
    assert r.returncode == 3
    assert calls[:2] == [
        "ruff check gpt2_port checks tests benchmarks scripts",
        "ruff format --check gpt2_port checks tests benchmarks scripts",
    ]
    assert calls[2] == "python -m pytest -q -k x"


@pytest.mark.parametrize("compiles", [True, False], ids=["compiles", "compile-fails"])
def test_a_fresh_venv_installs_in_one_pip_without_its_bytecode_pass_then_compiles_on_every_core(
    tmp_path: Path, compiles: bool
) -> None:
    """pip compiles the .pyc files in its one process (a third of a fresh .venv's setup); they are compiled after it on
    every core instead, before the import that checks the install, and the stamp is written only after both (the
    compile line itself runs in the fresh-clone CI: here python is a stand-in)."""
    root = _fake_checkout(tmp_path, 0, 0, pytest_rc=0)
    (root / ".venv" / ".gpt2port-installed").unlink()
    if not compiles:  # the stand-in python fails the compile step alone
        py = root / ".venv" / "bin" / "python"
        py.write_text(py.read_text().replace("exit 0\n", 'case "$*" in *compileall*) exit 1;; esac\nexit 0\n'))
    env = dict(os.environ, TORCH_SPEC="torch==2.13.0")
    r = subprocess.run(
        ["bash", str(root / "dev"), "test", "-k", "x"], cwd=root, env=env, capture_output=True, text=True
    )
    calls = (root / "calls.log").read_text().splitlines()
    if not compiles:
        assert r.returncode != 0 and not (root / ".venv" / ".gpt2port-installed").exists(), calls
        assert not any("-m pytest" in c for c in calls)
        return
    assert r.returncode == 0, (r.stderr, calls)
    pips = [c for c in calls if c.startswith("python -m pip install")]
    assert pips == ["python -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 -e .[dev]"]
    compiles = [i for i, c in enumerate(calls) if "compileall.compile_dir" in c and "workers=0" in c]
    check = calls.index("python -c import torch, transformers, gpt2_port")
    assert len(compiles) == 1 and calls.index(pips[0]) < compiles[0] < check < calls.index("python -m pytest -q -k x")
    assert (root / ".venv" / ".gpt2port-installed").read_text().split()[1] == "torch==2.13.0"


def _fake_python_for_the_floor(
    root: Path,
    check_rc: int,
    floor_pytest_rc: int,
    pip_pid_file: Path | None = None,
    venv_rc: int = 0,
    import_rc: int = 0,
) -> Path:
    """A stand-in for $PYTHON: `-m venv DIR` makes DIR/bin/python a logging stand-in (pip and the suite answer 0 or
    floor_pytest_rc; the script's check that the installed versions are the floors answers check_rc; `-c` (the import
    of this project) import_rc), or fails with venv_rc; anything else (scripts/floor_pins.py) runs on this
    interpreter. With `pip_pid_file`, pip writes its pid there and takes 120 s."""
    log = root / "calls.log"
    floor = root / "floor-python"
    slow_pip = f'[ "$2" = pip ] && echo $$ > {pip_pid_file} && exec sleep 120\n' if pip_pid_file else ""
    floor.write_text(
        "#!/bin/sh\n"
        f'echo "floor-python $* OMP=$OMP_NUM_THREADS ATEN=$ATEN_CPU_CAPABILITY" >> {log}\n'
        + slow_pip
        + f'case "$1" in scripts/floor_pins.py) exit {check_rc};;\n  -c) exit {import_rc};;\n'
        f'  -m) [ "$2" = pytest ] && exit {floor_pytest_rc};;\nesac\n'
        "exit 0\n"
    )
    py = root / "py"
    py.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = venv ]; then [ {venv_rc} = 0 ] || exit {venv_rc}; '
        f'mkdir -p "$3/bin" && cp {floor} "$3/bin/python"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    for f in (floor, py):
        f.chmod(0o755)
    (root / "scripts").mkdir()
    shutil.copy2(REPO / "scripts" / "floor_pins.py", root / "scripts" / "floor_pins.py")
    return py


@pytest.mark.parametrize(
    "suite_rc, check_rc, floor_rc, want_rc",
    [(0, 0, 0, 0), (0, 0, 4, 4), (1, 0, 0, 1), (0, 1, 0, 1)],
    ids=["all-pass", "floor-pass-fails", "suite-fails", "floor-not-at-the-pins"],
)
def test_the_second_pass_runs_the_exactness_tests_on_the_floors_after_a_green_suite(
    tmp_path: Path, suite_rc: int, check_rc: int, floor_rc: int, want_rc: int
) -> None:
    root = _fake_checkout(tmp_path, 0, 0, pytest_rc=suite_rc)
    py = _fake_python_for_the_floor(root, check_rc, floor_rc)
    env = dict(os.environ, TORCH_SPEC="torch==2.13.0", PYTHON=str(py))
    r = subprocess.run(["bash", str(root / "dev"), "test"], cwd=root, env=env, capture_output=True, text=True)
    calls = (root / "calls.log").read_text().splitlines()
    assert r.returncode == want_rc, (r.stderr, calls)
    assert "python -m pytest -q -n 2" in calls  # the suite, in .venv, in two pytest-xdist processes
    floor_suite = [c for c in calls if c.startswith("floor-python -m pytest")]
    if suite_rc or check_rc:  # a red suite, or a .venv-floor that is not at the floors: no second pass
        assert floor_suite == []
        if check_rc:
            assert "setup: .venv-floor failed" in r.stderr
            assert any(
                c.startswith("floor-python scripts/floor_pins.py --check .venv-floor/floor-pins.txt") for c in calls
            )
        return
    pins = (root / ".venv-floor" / "floor-pins.txt").read_text().split()
    want = subprocess.run([sys.executable, str(REPO / "scripts" / "floor_pins.py")], capture_output=True, text=True)
    assert pins == want.stdout.split() and any(p.startswith("torch==") for p in pins)
    # the pinned dependencies first (beside .venv's setup: nothing built in the checkout), then, after the suite, this
    # project, editable (built in the checkout, as .venv's was), under the same pins
    installs = [c for c in calls if c.startswith("floor-python -m pip install")]
    assert len(installs) == 2 and "-r .venv-floor/floor-pins.txt" in installs[0] and "-e" not in installs[0].split()
    assert "-c .venv-floor/floor-pins.txt -e .[dev]" in installs[1]
    assert calls.index(installs[1]) > calls.index("python -m pytest -q -n 2")
    assert floor_suite == ["floor-python -m pytest -q -p no:cacheprovider -n 2 -m exactness OMP=1 ATEN=default"]


@pytest.mark.parametrize("fails", ["venv", "project"])
def test_a_floor_venv_not_made_or_without_this_project_fails_before_its_tests(tmp_path: Path, fails: str) -> None:
    """The background install failing (here the venv cannot be made), or this project missing from .venv-floor after
    its install (pip's failures pass through its filter, so the import is what tells): "setup: .venv-floor failed",
    exit 1, no second pass, and no stamp saying the venv is complete."""
    root = _fake_checkout(tmp_path, 0, 0, pytest_rc=0)
    py = _fake_python_for_the_floor(root, 0, 0, venv_rc=int(fails == "venv"), import_rc=int(fails == "project"))
    env = dict(os.environ, TORCH_SPEC="torch==2.13.0", PYTHON=str(py))
    r = subprocess.run(["bash", str(root / "dev"), "test"], cwd=root, env=env, capture_output=True, text=True)
    calls = (root / "calls.log").read_text().splitlines()
    assert r.returncode == 1 and "setup: .venv-floor failed" in r.stderr, (r.stderr, calls)
    assert "python -m pytest -q -n 2" in calls and not any(c.startswith("floor-python -m pytest") for c in calls)
    assert not (root / ".venv-floor" / ".gpt2port-installed").exists()
    assert any(c.startswith("floor-python -c import gpt2_port_checks") for c in calls) == (fails == "project")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has stopped; only its parent's wait is missing


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("fails", ["lint", "suite"])
def test_the_floor_install_runs_beside_the_venv_setup_and_stops_when_a_step_fails(tmp_path: Path, fails: str) -> None:
    """.venv-floor's pip starts before the lint (so it has the second core while .venv installs), and a failing lint
    or suite leaves no pip behind: the stand-in ruff waits (up to 20 s) for the floor's pip to have started."""
    root = _fake_checkout(tmp_path, int(fails == "lint"), 0, pytest_rc=int(fails == "suite"))
    pid_file = root / "floor-pip.pid"
    ruff = root / ".venv" / "bin" / "ruff"
    waits = f"i=0; while [ ! -s {pid_file} ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done\n"
    ruff.write_text(ruff.read_text().replace("#!/bin/sh\n", "#!/bin/sh\n" + waits, 1))
    py = _fake_python_for_the_floor(root, 0, 0, pip_pid_file=pid_file)
    env = dict(os.environ, TORCH_SPEC="torch==2.13.0", PYTHON=str(py))
    r = subprocess.run(["bash", str(root / "dev"), "test"], cwd=root, env=env, capture_output=True, text=True)
    calls = (root / "calls.log").read_text().splitlines()
    assert r.returncode == 1, (r.stderr, calls)
    assert ("python -m pytest -q -n 2" in calls) == (fails == "suite")
    assert pid_file.is_file(), calls  # the floor's pip had started by the time the lint ran
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    running = _running(pid)
    if running:
        os.kill(pid, 9)
    assert not running, "the floor's pip was left running"


def test_without_a_command_it_prints_its_usage_and_exits_2() -> None:
    r = subprocess.run(["bash", str(REPO / "dev")], capture_output=True, text=True)
    lines = r.stdout.splitlines()
    assert r.returncode == 2 and lines[0].startswith("gpt2_port's one entry point")
    assert [ln.split()[1] for ln in lines if ln.startswith("  ./dev ")] == ["demo", "test", "bench", "floor"]
    assert lines[-1].startswith("Environment:")  # the header and nothing of the script after it
