"""Small helpers shared by the commands: atomic file writes and early checks that an output path is writable."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import UsageError


def check_writable(path: str | os.PathLike[str], what: str = "--json") -> Path:
    """Fail early (before any work) if `path` cannot be written: a directory, or a parent that is missing/read-only."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{what} {p}: is a directory, expected a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{what} {p}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{what} {p}: directory {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"{what} {p}: file exists and is not writable")
    return p


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a half-written file."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".partial", dir=p.parent if str(p.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
