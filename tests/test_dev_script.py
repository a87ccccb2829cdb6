"""./dev, the README's two commands: run here with stand-ins for .venv's python and ruff (an installed .venv is
pretended by its stamp), so what the script does with their exit codes is checked without installing anything."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
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
