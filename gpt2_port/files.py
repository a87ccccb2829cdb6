"""Every file gpt2_port writes goes through here: one writer, one directory probe, one way to commit a directory.

What a write does, by what is at the path (symlinks are followed to their final target, and the link stays):

- nothing, or a regular file: the data goes to a temporary file in the same directory, flushed to the disk
  (fsync), then renamed over the target (`os.replace`), then the directory itself is flushed, so neither a crash
  nor a power loss can leave a half-written or empty file where a complete one was;
- a character device (/dev/null, /dev/stdout, a terminal) or a FIFO: written in place, never replaced;
- a directory, a block device or a socket: refused, by `check_writable` before any work is done;
- one of the command's own inputs (the same file, however it is reached: a symlink, a hard link): refused, by
  `check_writable` and `check_dir_writable` given the inputs, before any work is done;
- `-`: standard output (`write_output` only); an empty path: refused.

`check_writable` and `check_dir_writable` create and delete a real file where the output will go (os.access says
yes to root on a read-only or virtual file system). A write that still fails after the work (a full disk,
/dev/full) raises UsageError with one line and, where it can, keeps the results in a file in the system's temporary
directory, named in the message.

Directories of several files (a checkpoint, a trainer state) are written into a hidden temporary directory beside
the target and then moved into place file by file (`commit_files`, the file that marks the set complete moved last)
or as a whole (`replace_dir`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import UsageError

STDOUT = "-"  # an output path that means standard output

# The files a command reads (or keeps), to keep its outputs off them: (what the file is, as a phrase for a message,
# e.g. "the --text input a.txt", the file)
Inputs = Iterable[tuple[str, str | os.PathLike[str]]]


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


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename into it) to the disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems (tmpfs in places, network mounts) refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def _new_mode(directory: bool = False) -> int:
    """The mode open() and mkdir() give a new file (0o666) or directory (0o777) under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


# -- probes (before any work) ----------------------------------------------------------------------------------------
def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether a write to `a` lands on `b`: the same path once every symlink is followed. (A hard link is another
    path: a write renames a new file over it and the other link keeps the old data.)"""
    return target_of(a) == target_of(b)


def input_at(path: str | os.PathLike[str], inputs: Inputs) -> str | None:
    """What `path` is among `inputs` (e.g. "the --text input a.txt"), or None when it is none of them."""
    for label, p in inputs:
        if same_file(path, p):
            return label
    return None


def _not_empty(path: str | os.PathLike[str], what: str, expected: str) -> None:
    if os.fspath(path) == "":
        raise UsageError(f"{what} '': an empty path; expected {expected}")


def check_writable(path: str | os.PathLike[str], what: str = "--json", inputs: Inputs = ()) -> Path | None:
    """Fail early, before any work, if output to `path` could not be written, or would overwrite one of `inputs`
    (the files the command reads); return the target (None for `-`)."""
    if os.fspath(path) == STDOUT:
        return None
    _not_empty(path, what, "a file path (or - for stdout)")
    t = target_of(path)
    shown = _shown(path, t)
    label = input_at(path, inputs)
    if label is not None:
        raise UsageError(f"{what} {shown}: is {label}; writing there would destroy it, so give another path")
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


def _existing_dir(path: str | os.PathLike[str], what: str) -> tuple[Path, str, Path]:
    """(target, how it is shown, its nearest existing ancestor), or UsageError when the target or that ancestor is
    not a directory."""
    t = target_of(path)
    shown = _shown(path, t)
    if _kind(t) not in ("directory", "missing", "under a file"):
        raise UsageError(f"{what} {shown}: exists and is not a directory")
    base = t
    while not (base.exists() or base.is_symlink()):
        base = base.parent
    if not base.is_dir():
        raise UsageError(f"{what} {shown}: {base} is a file, not a directory")
    return t, shown, base


def _probe(directory: Path) -> None:
    """Create and delete a real file in `directory` (OSError when that cannot be done)."""
    fd, probe = tempfile.mkstemp(prefix=".gpt2-port.", suffix=".probe", dir=directory)
    os.close(fd)
    os.unlink(probe)


def check_dir_outputs(
    path: str | os.PathLike[str], what: str = "--out", inputs: Inputs = (), writes: Iterable[str] = ()
) -> None:
    """Refuse an empty directory path, and one where a file the command writes (`writes`: names) is one of `inputs`
    (the files the command reads)."""
    _not_empty(path, what, "a directory path")
    t = target_of(path)
    for name in writes:
        label = input_at(t / name, inputs)
        if label is not None:
            raise UsageError(
                f"{what} {_shown(path, t)}: the command writes {name} there, which is {label}; writing it would "
                "destroy it, so give another directory"
            )


def check_dir_writable(
    path: str | os.PathLike[str], what: str = "--out", inputs: Inputs = (), writes: Iterable[str] = ()
) -> Path:
    """Fail early if files cannot be written into directory `path` (made later if missing): probe with a real file
    in it, or a real directory in its nearest existing ancestor. Nothing is left behind. `inputs` and `writes`: see
    `check_dir_outputs`."""
    check_dir_outputs(path, what, inputs, writes)
    t, shown, base = _existing_dir(path, what)
    try:
        if t.is_dir():
            _probe(t)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".gpt2-port.", suffix=".probe", dir=base))
    except OSError as e:
        raise UsageError(
            f"{what} {shown}: cannot create files in {base} ({e.strerror or e}): cannot write the output there"
        ) from None
    return t


def make_dirs(path: str | os.PathLike[str], what: str = "--out") -> list[Path]:
    """Create directory `path` and its missing parents, and probe it with a real file; return the directories made
    (for `remove_dirs` on failure). UsageError naming `what` when it cannot be made or written into."""
    out = Path(path)
    t, shown, base = _existing_dir(out, what)
    missing: list[Path] = []
    p = t
    while p != base:
        missing.append(p)
        p = p.parent
    created: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError as e:
        remove_dirs(created)
        raise UsageError(f"{what} {shown}: cannot create directory {e.filename or out} ({e.strerror or e})") from None
    try:
        _probe(t)
    except OSError as e:
        remove_dirs(created)
        raise UsageError(f"{what} {shown}: cannot create files in {t} ({e.strerror or e})") from None
    return created


def remove_dirs(created: list[Path]) -> None:
    """Remove the directories `make_dirs` created (deepest first), with anything written into them."""
    for d in reversed(created):
        shutil.rmtree(d, ignore_errors=True)


# -- writing one file ------------------------------------------------------------------------------------------------
class PendingFile:
    """A hidden temporary file beside `path`, open for binary writing; `commit()` flushes it to the disk and renames
    it over `path` (keeping a replaced file's permissions); `discard()` removes it. Used for files written in one go
    (`atomic_open`) and for files that grow over a long job (prepare's .bin files)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        kind = _kind(self.path)
        self.mode = stat.S_IMODE(os.stat(self.path).st_mode) if kind == "regular" else _new_mode()
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial", dir=self.path.parent)
        self.tmp = Path(tmp)
        self.f: BinaryIO = os.fdopen(fd, "wb")

    def commit(self) -> None:
        try:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.chmod(self.tmp, self.mode)
            os.replace(self.tmp, self.path)
        except BaseException:
            self.discard()
            raise
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.f.close()
        self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: committed (fsync, rename, directory fsync) on success, written in place
    for a device or a FIFO, or standard output for `-`.

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
    pending = PendingFile(t)
    try:
        yield pending.f
    except BaseException:
        pending.discard()
        raise
    pending.commit()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` (see atomic_open); OSError if the write fails, with the old file intact."""
    with atomic_open(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one line to a log file (a record at a time: a crash loses at most the line being written)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line.rstrip("\n") + "\n")


def write_output(path: str | os.PathLike[str], data: str | bytes, what: str = "--json") -> str:
    """Write a command's output (JSON, Markdown, PNG) to `path`, or to stdout for `-`; return the path as given
    (STDOUT for stdout: a file named "stdout" is a file).

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
    return os.fspath(path)


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


# -- writing a directory of files ------------------------------------------------------------------------------------
@contextlib.contextmanager
def staging_dir(parent: str | os.PathLike[str], prefix: str) -> Iterator[Path]:
    """A hidden temporary directory inside `parent` to write a set of files into; removed with whatever is left in
    it when the block ends (after `commit_files` or `replace_dir`, nothing is). It has the mode mkdir() would give
    (mkdtemp's own is 0o700, which `replace_dir` would otherwise leave on the directory it puts in place)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{prefix}-", suffix=".partial", dir=parent))
    try:
        os.chmod(tmp, _new_mode(directory=True))
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def commit_files(tmp: Path, out: Path, last: str | None = None) -> None:
    """Move every file of the staging directory `tmp` into `out`. `last`: the file whose presence says the set is
    complete (a trainer state's JSON): removed from `out` first and moved in last, so a run killed in between never
    leaves it beside files of another set. The files are flushed to the disk before the first move."""
    files = sorted(f for f in tmp.iterdir() if f.name != last)
    marker = tmp / last if last is not None and (tmp / last).exists() else None
    for f in [*files, *([marker] if marker else [])]:
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if last is not None:
        (out / last).unlink(missing_ok=True)
        fsync_dir(out)
    for f in files:
        os.replace(f, out / f.name)
    fsync_dir(out)
    if marker is not None:
        os.replace(marker, out / last)  # type: ignore[operator]
        fsync_dir(out)
    tmp.rmdir()


def replace_dir(tmp: Path, dst: Path) -> None:
    """Put directory `tmp` at `dst` by renames: the old one moved aside, the new one in, the old one deleted."""
    old = dst.with_name(f".{dst.name}.old")
    if old.exists():
        shutil.rmtree(old)
    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    fsync_dir(dst.parent)
    if old.exists():
        shutil.rmtree(old)
