"""Print pyproject.toml's version floors as pip pins: each `name>=X` of [project] dependencies and every extra becomes
`name==X` (with its environment marker, `name==X; marker`, where it has one), one a line. `./dev` installs
.venv-floor under these as constraints, so the lowest versions pyproject declares are the versions that venv tests.

    python scripts/floor_pins.py [PYPROJECT]
    python scripts/floor_pins.py --check PINS    (in .venv-floor, after pip: is each pin what got installed?)

A requirement without a `>=` floor, or a name whose floors differ between lists, is an error (exit 2). `--check` names
every package whose installed version is not its pin ("2.11" and "2.11.0" are equal; a local tag like "+cu128" is
ignored), or that is not installed, in one line, exit 1; a pin whose marker does not hold here is not looked for.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

# name>=floor, and an environment marker after a ";" where a package exists on some platforms only (triton: Linux)
REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:;\s*(\S.*?))?\s*$")


def requirements(text: str) -> list[str]:
    """The requirement strings of [project] dependencies and [project.optional-dependencies], in file order."""
    project = tomllib.loads(text)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return reqs


def floor_pins(text: str) -> list[str]:
    """`name==floor` for every requirement, each name once (names compared as pip compares them)."""
    pins: dict[str, str] = {}
    markers: dict[str, str] = {}
    for req in requirements(text):
        m = REQ.match(req)
        if m is None:
            raise ValueError(f"requirement {req!r}: expected 'name>=version' (a floor to test)")
        name, floor = re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2)
        if pins.setdefault(name, floor) != floor:
            raise ValueError(f"requirement {name}: floors {pins[name]} and {floor} differ between lists")
        if m.group(3):
            markers[name] = m.group(3)
    return [f"{name}=={floor}" + (f"; {markers[name]}" if name in markers else "") for name, floor in pins.items()]


def applies(marker: str) -> bool:
    """Whether a pin's environment marker holds for this interpreter (packaging's rule, as pip applies it)."""
    try:
        from packaging.markers import Marker
    except ImportError:  # pip's own copy, where packaging is not installed apart
        from pip._vendor.packaging.markers import Marker
    return Marker(marker).evaluate()


def _version_key(version: str) -> list[int | str]:
    """A version's release parts with trailing zeros dropped, so that "2.11" and "2.11.0" compare equal."""
    parts: list[int | str] = [int(x) if x.isdigit() else x for x in version.split("+")[0].split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return parts


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def off_pins(pins: list[str]) -> list[str]:
    """`name VERSION (want PIN)` for each `name==PIN` this interpreter does not have installed at exactly PIN (a pin
    whose marker, after a ";", does not hold here is not looked for)."""
    bad = []
    for line in pins:
        pin, _, marker = line.partition(";")
        if marker.strip() and not applies(marker.strip()):
            continue  # not installed here, by its marker
        name, want = pin.strip().split("==")
        have = _installed(name)
        if have is None or _version_key(have) != _version_key(want):
            bad.append(f"{name} {have.split('+')[0] if have else 'not installed'} (want {want})")
    return bad


def check(path: Path) -> int:
    try:
        pins = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as e:
        print(f"floor_pins: {path}: {e}", file=sys.stderr)
        return 2
    if malformed := [p for p in pins if p.partition(";")[0].count("==") != 1]:
        print(f"floor_pins: {path}: {malformed[0]!r}: expected 'name==version'", file=sys.stderr)
        return 2
    if bad := off_pins(pins):
        print(f"floor_pins: not at the floors: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"]:
        if len(argv) != 2:
            print("floor_pins: --check takes one argument, the pins file", file=sys.stderr)
            return 2
        return check(Path(argv[1]))
    path = Path(argv[0] if argv else Path(__file__).resolve().parents[1] / "pyproject.toml")
    try:
        pins = floor_pins(path.read_text())
    except (OSError, ValueError, KeyError) as e:
        print(f"floor_pins: {path}: {e}", file=sys.stderr)
        return 2
    print("\n".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
