"""Print pyproject.toml's version floors as pip pins: each `name>=X` of [project] dependencies and every extra becomes
`name==X`, one a line. `./dev` installs .venv-floor under these as constraints, so the lowest versions pyproject
declares are the versions that venv tests.

    python scripts/floor_pins.py [PYPROJECT]

A requirement without a `>=` floor, or a name whose floors differ between lists, is an error (exit 2).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9][0-9A-Za-z.]*)\s*$")


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
    for req in requirements(text):
        m = REQ.match(req)
        if m is None:
            raise ValueError(f"requirement {req!r}: expected 'name>=version' (a floor to test)")
        name, floor = re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2)
        if pins.setdefault(name, floor) != floor:
            raise ValueError(f"requirement {name}: floors {pins[name]} and {floor} differ between lists")
    return [f"{name}=={floor}" for name, floor in pins.items()]


def main(argv: list[str]) -> int:
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
