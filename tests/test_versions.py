"""The declared versions are the tested versions: pyproject's floors are what `./dev` pins .venv-floor to, the torch
releases where the fused loss calls torch's private log-softmax ops are exactly the two CI tests (the floor and .venv's
pin), and scripts/floor_pins.py refuses a requirement it cannot pin."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpt2_port.model import fused

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "floor_pins.py"


def _floor_pins():
    spec = importlib.util.spec_from_file_location("floor_pins", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_dependency_is_pinned_to_its_floor() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pins = dict(line.partition(";")[0].strip().split("==") for line in r.stdout.splitlines())
    text = (REPO / "pyproject.toml").read_text()
    project = text[text.index("[project]") : text.index("[project.scripts]")]  # not [build-system]'s setuptools
    declared = re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:;[^"]*)?"', project)
    assert declared and {n.lower(): v for n, v in declared} == pins
    assert {"torch", "transformers", "huggingface-hub", "safetensors", "numpy", "triton"} <= set(pins)
    assert "triton==3.6; sys_platform == 'linux'" in r.stdout.splitlines()  # its marker kept: pip applies it


def test_the_private_ops_are_listed_for_exactly_the_two_torches_ci_tests() -> None:
    pins = _floor_pins().floor_pins((REPO / "pyproject.toml").read_text())
    floor = dict(line.partition(";")[0].split("==") for line in pins)["torch"]
    (pin,) = re.findall(r"TORCH_SPEC:-torch==([0-9.]+)", (REPO / "dev").read_text())
    assert fused.PRIVATE_OPS_TESTED == {fused.minor_version(floor), fused.minor_version(pin)}


@pytest.mark.parametrize(
    "deps, message",
    [
        ('["torch"]', "requirement 'torch': expected 'name>=version'"),
        ('["torch<3"]', "requirement 'torch<3': expected 'name>=version'"),
        ('["torch>=2.11", "numpy>=2"]\n[project.optional-dependencies]\nx = ["Torch>=2.13"]', "floors 2.11 and 2.13"),
    ],
)
def test_a_requirement_without_one_floor_is_refused(tmp_path: Path, deps: str, message: str) -> None:
    py = tmp_path / "pyproject.toml"
    py.write_text(f'[project]\nname = "x"\ndependencies = {deps}\n')
    r = subprocess.run([sys.executable, str(SCRIPT), str(py)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and str(py) in r.stderr and message in r.stderr, r.stderr


def test_a_missing_or_broken_pyproject_is_one_line(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.toml", tmp_path / "broken.toml"):
        if path.name == "broken.toml":
            path.write_text("[project\n")
        r = subprocess.run([sys.executable, str(SCRIPT), str(path)], capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(path) in r.stderr, r.stderr


def test_the_check_names_each_package_off_its_pin_in_one_line(tmp_path: Path) -> None:
    """`--check` (what ./dev runs in .venv-floor after pip), here on this interpreter: equal versions pass however they
    are written ("9.2" is "9.2.0"); a different or missing package is named, in one line, exit 1."""
    import importlib.metadata

    have = importlib.metadata.version("pytest")
    pins = tmp_path / "pins.txt"
    pins.write_text(f"pytest=={have[:-2] if have.endswith('.0') else have + '.0'}\n")  # written the other way
    r = subprocess.run([sys.executable, str(SCRIPT), "--check", str(pins)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    pins.write_text(f"pytest=={have}\ntorch==0.1\nno-such-package==1.0\n")
    r = subprocess.run([sys.executable, str(SCRIPT), "--check", str(pins)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "torch " in r.stderr and "(want 0.1)" in r.stderr and "no-such-package not installed (want 1.0)" in r.stderr
    assert "pytest" not in r.stderr


def test_a_pin_whose_marker_does_not_hold_here_is_not_looked_for(tmp_path: Path) -> None:
    """A requirement with an environment marker (`triton>=3.6; sys_platform == 'linux'`) keeps it in its pin, and
    `--check` looks for the package only where the marker holds: a missing package under a marker that is false here
    passes, under one that is true it is named."""
    py = tmp_path / "pyproject.toml"
    deps = '["torch>=2.11", "no-such-package>=1.0; python_version < \'3\'"]'
    py.write_text(f'[project]\nname = "x"\ndependencies = {deps}\n')
    r = subprocess.run([sys.executable, str(SCRIPT), str(py)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.splitlines() == ["torch==2.11", "no-such-package==1.0; python_version < '3'"]
    pins = tmp_path / "pins.txt"
    for marker, rc in (("python_version < '3'", 0), ("python_version >= '3'", 1)):
        pins.write_text(f"no-such-package==1.0; {marker}\n")
        r = subprocess.run([sys.executable, str(SCRIPT), "--check", str(pins)], capture_output=True, text=True)
        assert r.returncode == rc and ("no-such-package not installed" in r.stderr) == bool(rc), (marker, r.stderr)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--check"], "--check takes one argument"),
        (["--check", "absent.txt"], "absent.txt"),
        (["--check", "bad.txt"], "'torch>=2': expected 'name==version'"),
    ],
)
def test_a_bad_check_argument_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "bad.txt").write_text("torch>=2\n")
    r = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr
