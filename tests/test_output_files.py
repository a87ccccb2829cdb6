"""Output files: only a regular file is ever replaced (or a missing one created), symlinks are written through,
devices and FIFOs are written in place, `-` is stdout, the early check makes a real file, and a write that fails
after the work is one line that says where the results were kept. These tests run as root in CI, where os.access
always says yes: the failures used are the ones root meets too (/dev/full, /proc, a path under a regular file)."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from gpt2_port.cli import main
from gpt2_port.errors import UsageError
from gpt2_port.files import atomic_write_text, check_dir_writable, check_writable, write_output

needs_dev_full = pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full is Linux only")


@pytest.fixture
def kept_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system temporary directory, made private to the test (where failed writes keep their results)."""
    d = tmp_path / "systmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _is_chr(p: str) -> bool:
    return stat.S_ISCHR(os.stat(p).st_mode)


def test_regular_file_replaced_atomically_keeping_its_mode(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text("old\n")
    p.chmod(0o600)
    assert check_writable(p) == p
    assert write_output(p, '{"a": 1}\n') == str(p)
    assert p.read_text() == '{"a": 1}\n' and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]  # no probe or temp file left


def test_symlink_is_written_through_and_stays_a_link(tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    check_writable(link)
    write_output(link, "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")  # a link to a file not there yet: the write makes it
    check_writable(dangling)
    write_output(dangling, "x\n")
    assert dangling.is_symlink() and (tmp_path / "made.json").read_text() == "x\n"


def test_dash_is_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert check_writable("-") is None
    assert write_output("-", '{"a": 1}\n') == "-"
    assert capfd.readouterr().out == '{"a": 1}\n'
    assert not (tmp_path / "-").exists()


def test_a_file_named_stdout_is_a_file_and_is_reported(tmp_path: Path, monkeypatch, capsys) -> None:
    """Only `-` is standard output: a file named `stdout` is written there and its `wrote` line is said."""
    from gpt2_port.cli.common import report_written

    monkeypatch.chdir(tmp_path)
    report_written([write_output("stdout", "x\n"), write_output("r.md", "y\n")])
    assert (tmp_path / "stdout").read_text() == "x\n"
    assert capsys.readouterr().out == "wrote stdout\nwrote r.md\n"


def test_fifo_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    check_writable(fifo)
    write_output(fifo, "through the pipe\n")
    reader.join(10)
    assert got == [b"through the pipe\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # not replaced by a regular file
    assert sorted(x.name for x in tmp_path.iterdir()) == ["pipe"]


def test_char_device_written_in_place(tmp_path: Path) -> None:
    check_writable("/dev/null")
    write_output("/dev/null", "gone\n")
    assert _is_chr("/dev/null")


@needs_dev_full
def test_dev_full_fails_in_one_line_keeps_the_results_and_stays_a_device(kept_dir: Path) -> None:
    check_writable("/dev/full")  # it opens; only the write fails
    with pytest.raises(UsageError) as e:
        write_output("/dev/full", '{"results": [1, 2, 3]}\n', "--json")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--json /dev/full: cannot write (No space left on device)")
    kept = list(kept_dir.iterdir())
    assert len(kept) == 1 and kept[0].suffix == ".out" and f"the results are kept in {kept[0]}" in msg
    assert kept[0].read_text() == '{"results": [1, 2, 3]}\n'
    assert _is_chr("/dev/full")


def test_proc_path_fails_the_early_check() -> None:
    """os.access says /proc is writable for root; creating a file there is what really fails."""
    with pytest.raises(UsageError, match=r"--json /proc/out\.json: cannot create a file in /proc"):
        check_writable("/proc/out.json", "--json")
    assert not Path("/proc/out.json").exists()


def test_path_under_a_regular_file_and_missing_dir_and_directory(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UsageError, match=r"directory .*afile is not a directory"):
        check_writable(f / "out.json")
    with pytest.raises(UsageError, match=r"directory .*nodir does not exist"):
        check_writable(tmp_path / "nodir" / "out.json")
    with pytest.raises(UsageError, match="is a directory, expected a file path"):
        check_writable(tmp_path)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["afile"]


def test_socket_and_block_device_refused_early(tmp_path: Path) -> None:
    sock_path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(sock_path))
        with pytest.raises(UsageError, match="is a socket; expected a regular file"):
            check_writable(sock_path, "--json")
    finally:
        s.close()
    blk = tmp_path / "blk"
    try:
        os.mknod(blk, 0o600 | stat.S_IFBLK, os.makedev(7, 200))
    except PermissionError:  # no CAP_MKNOD here: the socket above covers the same branch
        return
    with pytest.raises(UsageError, match="is a block device"):
        check_writable(blk, "--json")
    assert stat.S_ISBLK(os.stat(blk).st_mode)


def test_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept_dir: Path) -> None:
    """The rename never happens when the data could not be written; the old file stays, no temp file is left."""
    from gpt2_port import files as util

    p = tmp_path / "out.json"
    p.write_text("old\n")
    real_replace = os.replace

    def no_space(src, dst):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(util.os, "replace", no_space)
    with pytest.raises(UsageError, match="cannot write .No space left on device.; the results are kept in"):
        write_output(p, "new\n", "--json")
    monkeypatch.setattr(util.os, "replace", real_replace)
    assert p.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.json", "systmp"]
    assert [k.read_text() for k in kept_dir.iterdir()] == ["new\n"]


def test_atomic_write_text_raises_oserror_untouched(tmp_path: Path) -> None:
    """The low-level writer raises OSError (the caller decides); write_output turns it into UsageError."""
    with pytest.raises(OSError):
        atomic_write_text(tmp_path / "nodir" / "x.json", "x")


def test_check_dir_writable(tmp_path: Path) -> None:
    check_dir_writable(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()  # the probe directory is gone, nothing made
    check_dir_writable(tmp_path)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("x")
    with pytest.raises(UsageError, match="exists and is not a directory"):
        check_dir_writable(tmp_path / "f")
    with pytest.raises(UsageError, match="cannot create files in /proc"):
        check_dir_writable("/proc/newdir")


# -- the commands ------------------------------------------------------------------------------------------------


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert lines and lines[-1].startswith("gpt2-port ") and ": error: " in lines[-1], err
    assert "Traceback" not in err
    return lines[-1]


def test_inspect_json_to_stdout(
    tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--json -`: stdout is the JSON alone (the readable report moves to stderr), and no file named `-`."""
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(tiny_official), "--json", "-"]) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["model"] == str(tiny_official) and "key mapping" in err
    assert not (tmp_path / "-").exists()


def test_inspect_says_what_it_wrote(tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "i.json"
    assert main(["inspect", str(tiny_official), "--json", str(p)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {p}"


@needs_dev_full
def test_generate_json_dev_full(tiny_official: Path, kept_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The write fails after the work: exit 2, one line, the JSON kept, /dev/full still a device."""
    rc = main(["generate", str(tiny_official), "Hello", "--greedy", "--max-new-tokens", "3", "--json", "/dev/full"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--json /dev/full: cannot write" in line and "kept in" in line
    kept = list(kept_dir.iterdir())
    assert len(kept) == 1 and str(kept[0]) in line
    assert len(json.loads(kept[0].read_text())["generated_ids"][0]) == 3
    assert _is_chr("/dev/full")


def test_generate_json_proc_fails_before_the_load(
    tiny_official: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gpt2_port.model as load

    def no_load(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(load, "from_pretrained", no_load)
    rc = main(["generate", str(tiny_official), "Hello", "--json", "/proc/out.json"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--json /proc/out.json: cannot create a file in /proc" in line


def test_generate_json_symlink_and_wrote_line(
    tiny_official: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "t.json"
    target.write_text("old")
    link = tmp_path / "l.json"
    link.symlink_to(target)
    assert (
        main(["generate", str(tiny_official), "Hello", "--greedy", "--max-new-tokens", "2", "--json", str(link)]) == 0
    )
    out, err = capsys.readouterr()
    assert link.is_symlink() and len(json.loads(target.read_text())["generated_ids"][0]) == 2
    assert f"wrote {link}" in err.splitlines() and "wrote" not in out  # stdout carries the text alone


def test_demo_checkpoint_out_unwritable(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo-checkpoint", "--out", "/proc/gpt2-demo"])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--out /proc/gpt2-demo: cannot create files in /proc" in line


@needs_dev_full
def test_attention_png_dev_full(tiny_official: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    rc = main(["attention", str(tiny_official), "Hello world", "--layer", "0", "--png", "/dev/full"])
    out, err = capsys.readouterr()
    line = _one_error_line(err)
    assert rc == 2 and "--png /dev/full: cannot write (No space left on device)" in line
    assert "wrote" not in out and _is_chr("/dev/full")


def test_demo_checkpoint_late_write_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while the checkpoint is written: exit 2, one line, no partial file left."""
    from gpt2_port import files as util

    real_fdopen = os.fdopen

    def full_disk(fd, mode="r", *a, **k):  # type: ignore[no-untyped-def]
        f = real_fdopen(fd, mode, *a, **k)

        def write(data):  # type: ignore[no-untyped-def]
            raise OSError(28, "No space left on device")

        f.write = write
        return f

    monkeypatch.setattr(util.os, "fdopen", full_disk)
    out = tmp_path / "ck"
    rc = main(["demo-checkpoint", "--out", str(out)])
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and f"--out {out}: cannot write the checkpoint (No space left on device)" in line
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_directory_put_in_place_has_the_mode_mkdir_gives(tmp_path: Path, umask: int) -> None:
    """A checkpoint directory written through staging_dir and put in place by replace_dir (train's `best/`) is as
    readable as one mkdir() would make under the umask (mkdtemp makes 0o700), and so are its files."""
    from gpt2_port.files import replace_dir, staging_dir

    old = os.umask(umask)
    try:
        (tmp_path / "plain").mkdir()
        with staging_dir(tmp_path, "best") as tmp:
            (tmp / "config.json").write_text("{}")
            replace_dir(tmp, tmp_path / "best")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "best").stat().st_mode)
    assert mode == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((tmp_path / "best" / "config.json").stat().st_mode) == 0o666 & ~umask
