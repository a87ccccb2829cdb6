"""Writing output files safely: an early check that the output can be written, and one atomic writer.

What a write does, by what is at the path (symlinks are followed to their final target, and the link stays):

- nothing, or a regular file: the data goes to a temporary file beside the target, which is then renamed over it,
  so a reader never sees a half-written file and a failed write leaves the old file as it was;
- a character device (/dev/null, /dev/stdout, a terminal) or a FIFO: written in place, never replaced;
- a directory, a block device or a socket: refused, by `check_writable` before any work is done;
- `-`: standard output (`write_output` only).

`check_writable` creates and deletes a real file where the output will go (os.access says yes to root on a read-only
or virtual file system). A write that still fails after the work (a full disk, /dev/full) raises UsageError with one
line and, where it can, keeps the results in a file in the system's temporary directory, named in the message.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import UsageError

STDOUT = "-"  # an output path that means standard output


def target_of(path: str | os.PathLike[str]) -> Path:
    """The file a write to `path` lands in: every symlink followed (a dangling one: the path it names)."""
    return Path(os.path.realpath(path))


def _kind(p: Path) -> str:
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "under a file"
    if stat.S_ISREG(mode):
        return "regular"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def _shown(path: str | os.PathLike[str], target: Path) -> str:
    """The path as the user gave it, with the symlink's target when it is one."""
    s = os.fspath(path)
    return s if os.path.abspath(s) == str(target) else f"{s} (-> {target})"


def check_writable(path: str | os.PathLike[str], what: str = "--json") -> Path | None:
    """Fail early, before any work, if output to `path` could not be written; return the target (None for `-`)."""
    if os.fspath(path) == STDOUT:
        return None
    t = target_of(path)
    shown = _shown(path, t)
    kind = _kind(t)
    if kind == "directory":
        raise UsageError(f"{what} {shown}: is a directory, expected a file path")
    if kind in ("block device", "socket", "special file"):
        raise UsageError(
            f"{what} {shown}: is a {kind}; expected a regular file (new or replaced), a character device, a FIFO, or -"
        )
    if kind == "character device":
        try:  # opening /dev/full succeeds (its writes fail later); a device with no driver or no permission fails here
            os.close(os.open(t, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK))
        except OSError as e:
            raise UsageError(f"{what} {shown}: cannot open the device for writing ({e.strerror or e})") from None
        return t
    if kind == "FIFO":  # opening it would wait for a reader; written in place at the end
        return t
    parent = t.parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() or kind == "under a file" else "does not exist"
        raise UsageError(f"{what} {shown}: directory {parent} {why}")
    try:  # a real file where the output will go: the only test that read-only, virtual and full file systems fail
        fd, probe = tempfile.mkstemp(prefix=f".{t.name}.", suffix=".probe", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{what} {shown}: cannot create a file in {parent} ({e.strerror or e})") from None
    return t


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: renamed into place on success, written in place for a device or a FIFO,
    or standard output for `-`.

    On an exception in the block (or a failed write) the temporary file is removed and the target is untouched.
    """
    if os.fspath(path) == STDOUT:
        sys.stdout.flush()  # text already printed comes first
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    t = target_of(path)
    kind = _kind(t)
    if kind in ("character device", "FIFO"):
        with open(t, "wb") as f:
            yield f
        return
    if kind not in ("regular", "missing"):
        raise UsageError(f"{_shown(path, t)}: is a {kind}; expected a regular file, a character device or a FIFO")
    if kind == "regular":
        mode = stat.S_IMODE(os.stat(t).st_mode)  # a replaced file keeps its permissions
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{t.name}.", suffix=".partial", dir=t.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, mode)
        os.replace(tmp, t)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` (see atomic_open); OSError if the write fails, with the old file intact."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_output(path: str | os.PathLike[str], data: str | bytes, what: str = "--json") -> str:
    """Write a command's output (JSON, Markdown, PNG) to `path`, or to stdout for `-`; return what to report.

    A failed write raises UsageError naming the path and the reason, and says where the results were kept.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        atomic_write_bytes(path, raw)
    except OSError as e:
        if os.fspath(path) == STDOUT:  # a closed pipe: nowhere to say more
            raise UsageError(f"{what} -: cannot write to stdout ({e.strerror or e})") from None
        kept = keep_results(raw, Path(path).suffix)
        where = f"; the results are kept in {kept}" if kept else ""
        raise UsageError(f"{what} {_shown(path, target_of(path))}: cannot write ({e.strerror or e}){where}") from None
    return "stdout" if os.fspath(path) == STDOUT else os.fspath(path)


def keep_results(data: bytes, suffix: str = "") -> str | None:
    """Save `data` to a new file in the system's temporary directory; its path, or None if that fails too."""
    try:
        fd, kept = tempfile.mkstemp(prefix="gpt2-port-results-", suffix=suffix or ".out")
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except OSError:
        Path(kept).unlink(missing_ok=True)
        return None
    return kept


def check_dir_writable(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """Fail early if files cannot be written into directory `path` (made later if missing): probe with a real file
    in it, or a real directory in its nearest existing ancestor."""
    t = target_of(path)
    shown = _shown(path, t)
    kind = _kind(t)
    if kind not in ("directory", "missing"):
        raise UsageError(f"{what} {shown}: exists and is not a directory")
    base = t
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise UsageError(f"{what} {shown}: {base} is not a directory")
    try:
        if kind == "directory":
            fd, probe = tempfile.mkstemp(prefix=".gpt2-port.", suffix=".probe", dir=t)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".gpt2-port.", suffix=".probe", dir=base))
    except OSError as e:
        raise UsageError(f"{what} {shown}: cannot create files in {base} ({e.strerror or e})") from None
    return t
