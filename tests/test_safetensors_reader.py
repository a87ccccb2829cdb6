"""Why gpt2_port reads safetensors itself instead of through `safetensors.safe_open` (io/safetensors_io.py's
docstring): each reason is asserted here against the installed safetensors, so a release that closes a gap fails
this test and the hand-written reader can be retired."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpt2_port.errors import CheckpointError
from gpt2_port.io.safetensors_io import SafetensorsFile


def _parts(tmp_path: Path) -> tuple[dict, bytes]:
    f = tmp_path / "base.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}, str(f))
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path: Path, header_bytes: bytes, data: bytes) -> Path:
    header_bytes += b" " * (-len(header_bytes) % 8)
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)
    return path


def _safe_open_reads(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_safe_open_accepts_a_tensor_named_twice_and_we_refuse_it(tmp_path: Path) -> None:
    """The catalogue's header_duplicate_key: a header that is not one JSON object of distinct names (RFC 8259 leaves
    duplicates to the parser, so readers may disagree on such a file) is a crafted or corrupt file."""
    header, data = _parts(tmp_path)
    hb = json.dumps(header).encode()
    f = _write(tmp_path / "twice.safetensors", hb[:-1] + b', "a": ' + json.dumps(header["a"]).encode() + b"}", data)
    assert set(_safe_open_reads(f)) == {"a", "b"}  # accepted
    with pytest.raises(CheckpointError, match="header names 'a' twice"):
        SafetensorsFile(f)


def test_safe_open_accepts_unknown_entry_keys_and_we_refuse_them(tmp_path: Path) -> None:
    header, data = _parts(tmp_path)
    header["a"]["quantization"] = "int4"  # a key some other tool would act on, read past here
    f = _write(tmp_path / "extra.safetensors", json.dumps(header).encode(), data)
    assert set(_safe_open_reads(f)) == {"a", "b"}
    with pytest.raises(CheckpointError, match="entry must have exactly dtype, shape and data_offsets"):
        SafetensorsFile(f)


def test_where_both_refuse_ours_names_the_fault_and_the_numbers(tmp_path: Path) -> None:
    header, data = _parts(tmp_path)
    a0, a1 = header["a"]["data_offsets"]
    b0, b1 = header["b"]["data_offsets"]
    hole = dict(header, b=dict(header["b"], data_offsets=[b0 + 4, b1 + 4]))
    cases = {
        "hole": (_write(tmp_path / "h.st", json.dumps(hole).encode(), data[:b0] + bytes(4) + data[b0:]), "a hole of 4"),
        "trailing": (_write(tmp_path / "t.st", json.dumps(header).encode(), data + bytes(8)), "8 trailing bytes"),
        "cut": (_write(tmp_path / "c.st", json.dumps(header).encode(), data[:-4]), f"[{b0}, {b1}] out of range"),
    }
    for name, (f, ours) in cases.items():
        with pytest.raises(Exception) as theirs:
            _safe_open_reads(f)
        assert "4" not in str(theirs.value) and "8" not in str(theirs.value), (name, theirs.value)  # no numbers
        with pytest.raises(CheckpointError, match=ours.replace("[", r"\[")):
            SafetensorsFile(f)
