"""A catalogue of bad inputs: hostile or broken files and bad arguments.

Each case asserts the four things issue 4 asks for: exit code 2; a one-line message on stderr that names the culprit
(file, key, argument or value) and what was expected; no traceback; no file left behind (the --json path, temp or
.partial files). Most cases run the CLI in-process (fast); a few run it as a real subprocess.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gpt2_port.cli import main
from gpt2_port.config import GPT2Config
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.io.safetensors_io import SafetensorsFile, write_safetensors
from gpt2_port.io.tokenizer import find_files

REPO = Path(__file__).resolve().parents[1]
BASE_CFG = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=1000)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A valid small checkpoint in the official layout (with tokenizer files) that each case copies and breaks."""
    return write_demo_checkpoint(
        tmp_path_factory.mktemp("bad_base"), config=BASE_CFG, seed=3, tokenizer_dir=tokenizer_dir
    )


# -- helpers to break files ------------------------------------------------------------------------------------------
def copy(base: Path, tmp: Path, name: str = "ck") -> Path:
    d = tmp / name
    shutil.copytree(base, d)
    return d


def split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(path: Path, header: dict, body: bytes) -> None:
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + body)


def rewrite(path: Path, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None) -> None:
    """Rewrite a safetensors file with some tensors dropped, replaced or added."""
    st = SafetensorsFile(path)
    tensors = {k: st.get(k).clone() for k in st.keys() if k not in drop}
    tensors.update(put or {})
    del st
    write_safetensors(
        path,
        [(k, tuple(t.shape), t.dtype, lambda t=t: t) for k, t in sorted(tensors.items())],
        metadata={"format": "pt"},
    )


def config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


class RunsCode:
    """A pickle payload that would create `marker` when unpickled without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


# -- the catalogue: each builder returns the argv, the substrings the error line must hold, and paths that must not
# exist afterwards (beyond the --json report, which is always checked) ----------------------------------------------
Case = Callable[[Path, Path], dict]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__.removeprefix("c_")] = fn
    return fn


@case
def c_path_missing(tmp: Path, base: Path) -> dict:
    return {"argv": ["inspect", str(tmp / "nope")], "expect": ["nope", "no such file or directory", "Hub model id"]}


@case
def c_dir_without_weights(tmp: Path, base: Path) -> dict:
    d = tmp / "empty_dir"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return {"argv": ["inspect", str(d)], "expect": ["empty_dir", "no weights found", "model.safetensors"]}


@case
def c_empty_file(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    (d / "model.safetensors").write_bytes(b"")
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "0 bytes", "too short", "8-byte header"]}


@case
def c_cut_inside_header(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    f.write_bytes(data[: 8 + n // 2])
    return {
        "argv": ["inspect", str(d)],
        "expect": ["model.safetensors", f"header length {n}", "past the end", "truncated"],
    }


@case
def c_cut_inside_data(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "data_offsets", "out of range", "truncated"]}


@case
def c_header_length_past_end(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", f"header length {len(data)}", "past the end"]}


@case
def c_header_length_huge(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    f.write_bytes(struct.pack("<Q", 2**62) + f.read_bytes()[8:])
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", str(2**62), "exceeds", "limit"]}


@case
def c_header_not_json(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff\xfe not json at all, sorry \x00\x01"
    f.write_bytes(bytes(data))
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "header is not valid UTF-8 JSON"]}


@case
def c_header_duplicate_key(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    header, body = split(f)
    hb = json.dumps(header).encode()
    hb = hb[:-1] + b', "wte.weight": ' + json.dumps(header["wte.weight"]).encode() + b"}"
    f.write_bytes(struct.pack("<Q", len(hb)) + hb + body)
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "'wte.weight' twice"]}


@case
def c_offsets_out_of_range(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    header, body = split(f)
    header["ln_f.bias"]["data_offsets"] = [len(body) - 64, len(body) + 64]
    join(f, header, body)
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "'ln_f.bias'", "data_offsets", "out of range"]}


@case
def c_offsets_overlap(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    header, body = split(f)
    a, b = "h.0.ln_1.bias", "h.0.ln_1.weight"  # same shape; b is stored right after a
    assert header[a]["data_offsets"][1] == header[b]["data_offsets"][0]
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    join(f, header, body)
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "'h.0.ln_1.weight'", "overlap"]}


@case
def c_unsupported_dtype(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    header, body = split(f)
    header["wpe.weight"]["dtype"] = "Q4_K"
    join(f, header, body)
    return {"argv": ["inspect", str(d)], "expect": ["'wpe.weight'", "unsupported dtype 'Q4_K'", "F32"]}


@case
def c_gpt2_medium_tensor(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    rewrite(d / "model.safetensors", put={"h.1.mlp.c_fc.weight": torch.zeros(1024, 4096)})
    return {
        "argv": ["inspect", str(d)],
        "expect": ["'h.1.mlp.c_fc.weight'", "expected shape (32, 128)", "found (1024, 4096)", "config.json"],
    }


@case
def c_missing_tensor(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    rewrite(d / "model.safetensors", drop=("h.1.ln_2.bias",))
    return {"argv": ["inspect", str(d)], "expect": ["missing key 'h.1.ln_2.bias'", "expected shape (32,)"]}


@case
def c_unknown_extra_tensor(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    rewrite(d / "model.safetensors", put={"h.0.attn.rotary_emb.inv_freq": torch.ones(8)})
    return {"argv": ["inspect", str(d)], "expect": ["unexpected key 'h.0.attn.rotary_emb.inv_freq'", "GPT-2"]}


def _llama(d: Path) -> None:
    d.mkdir()
    ts = {
        "model.embed_tokens.weight": torch.zeros(1000, 32),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32),
        "model.norm.weight": torch.ones(32),
        "lm_head.weight": torch.zeros(1000, 32),
    }
    write_safetensors(d / "model.safetensors", [(k, tuple(t.shape), t.dtype, lambda t=t: t) for k, t in ts.items()])


@case
def c_llama_with_its_config(tmp: Path, base: Path) -> dict:
    d = tmp / "llama"
    _llama(d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1}))
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "model_type is 'llama'", "expected 'gpt2'"]}


@case
def c_llama_without_config(tmp: Path, base: Path) -> dict:
    d = tmp / "llama"
    _llama(d)
    return {"argv": ["inspect", str(d)], "expect": ["'wte.weight'", "not a GPT-2 checkpoint"]}


@case
def c_llama_with_gpt2_config(tmp: Path, base: Path) -> dict:
    d = tmp / "llama"
    _llama(d)
    shutil.copy(base / "config.json", d / "config.json")
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors", "unexpected key 'model.", "GPT-2"]}


@case
def c_absurd_layer_index_without_config(tmp: Path, base: Path) -> dict:
    """Counting layers by the largest index would build a 10^11-layer model (a hang, then out of memory)."""
    d = copy(base, tmp)
    (d / "config.json").unlink()
    rewrite(d / "model.safetensors", put={"h.99999999999.ln_1.weight": torch.ones(32)})
    return {"argv": ["inspect", str(d)], "expect": ["no config.json", "not numbered 0..99999999999", "'h.2.*'"]}


@case
def c_config_malformed(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    (d / "config.json").write_text('{"n_layer": 2, "n_embd": 32,')
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "not valid JSON", "line 1"]}


@case
def c_config_not_an_object(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    (d / "config.json").write_text("[2, 32, 2]")
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "expected a JSON object", "list"]}


@case
def c_config_wrong_type(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    config(d, n_layer="2")
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "n_layer", "positive integer", "'2'"]}


@case
def c_config_contradicts_width(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    config(d, n_embd=48, n_head=3)
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "n_embd=48", "contradicts", "32 wide"]}


@case
def c_config_contradicts_layers(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    config(d, n_layer=24)
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "n_layer=24", "2 layers", "h.0 to h.1"]}


@case
def c_config_contradicts_vocab(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    config(d, vocab_size=50257)
    return {"argv": ["inspect", str(d)], "expect": ["config.json", "vocab_size=50257", "'wte.weight'", "1000"]}


@case
def c_mask_not_causal(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    rewrite(d / "model.safetensors", put={"h.1.attn.bias": torch.ones(1, 1, 32, 32)})
    return {"argv": ["inspect", str(d)], "expect": ["h.1.attn.bias", "not a causal", "lower-triangular"]}


@case
def c_nan_and_inf_weights(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    st = SafetensorsFile(d / "model.safetensors")
    a, b = st.get("h.0.mlp.c_fc.weight").clone(), st.get("ln_f.bias").clone()
    del st
    a[3, 5], b[0] = float("nan"), float("-inf")
    rewrite(d / "model.safetensors", put={"h.0.mlp.c_fc.weight": a, "ln_f.bias": b})
    return {
        "argv": ["inspect", str(d), "--check-finite"],
        "expect": ["NaN/Inf in 2 tensor(s)", "h.0.mlp.c_fc.weight", "ln_f.bias", "expected finite"],
    }


@case
def c_bin_pickle_runs_code(tmp: Path, base: Path) -> dict:
    d = tmp / "evil"
    d.mkdir()
    shutil.copy(base / "config.json", d / "config.json")
    marker = tmp / "pwned"
    torch.save({"wte.weight": RunsCode(marker)}, d / "pytorch_model.bin")
    return {
        "argv": ["inspect", str(d)],
        "expect": ["pytorch_model.bin", "refused to unpickle", "system", "not loaded"],
        "absent": [marker],
    }


@case
def c_bin_legacy_pickle_runs_code(tmp: Path, base: Path) -> dict:
    d = tmp / "evil_legacy"
    d.mkdir()
    marker = tmp / "pwned_legacy"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"wte.weight": RunsCode(marker)}))
    return {"argv": ["inspect", str(d)], "expect": ["pytorch_model.bin", "refused to unpickle"], "absent": [marker]}


@case
def c_bin_not_a_checkpoint(tmp: Path, base: Path) -> dict:
    d = tmp / "garbage_bin"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"<html>404 Not Found</html>")
    return {
        "argv": ["inspect", str(d)],
        "expect": ["pytorch_model.bin", "not a PyTorch checkpoint", "zip archive or a pickle"],
    }


@case
def c_bin_truncated(tmp: Path, base: Path) -> dict:
    d = tmp / "cut_bin"
    d.mkdir()
    torch.save({"wte.weight": torch.zeros(1000, 32)}, d / "pytorch_model.bin")
    data = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    return {"argv": ["inspect", str(d)], "expect": ["pytorch_model.bin", "not a readable PyTorch checkpoint"]}


@case
def c_symlink_loop(tmp: Path, base: Path) -> dict:
    (tmp / "loop_a").symlink_to(tmp / "loop_b")
    (tmp / "loop_b").symlink_to(tmp / "loop_a")
    return {"argv": ["inspect", str(tmp / "loop_a")], "expect": ["loop_a", "symlink loop"]}


@case
def c_broken_symlink(tmp: Path, base: Path) -> dict:
    (tmp / "dangling.safetensors").symlink_to(tmp / "gone.safetensors")
    return {"argv": ["inspect", str(tmp / "dangling.safetensors")], "expect": ["dangling", "broken symlink", "gone"]}


def _sharded(tmp: Path, base: Path) -> Path:
    d = copy(base, tmp)
    st = SafetensorsFile(d / "model.safetensors")
    keys = st.keys()
    halves = {
        "model-00001-of-00002.safetensors": keys[: len(keys) // 2],
        "model-00002-of-00002.safetensors": keys[len(keys) // 2 :],
    }
    for name, ks in halves.items():
        write_safetensors(d / name, [(k, st.infos[k].shape, st.infos[k].dtype, lambda k=k: st.get(k)) for k in ks])
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: n for n, ks in halves.items() for k in ks}})
    )
    return d


@case
def c_shard_index_names_missing_shard(tmp: Path, base: Path) -> dict:
    d = _sharded(tmp, base)
    (d / "model-00002-of-00002.safetensors").unlink()
    return {
        "argv": ["inspect", str(d)],
        "expect": ["model.safetensors.index.json", "'model-00002-of-00002.safetensors'", "missing"],
    }


@case
def c_shard_index_not_json(tmp: Path, base: Path) -> dict:
    d = _sharded(tmp, base)
    (d / "model.safetensors.index.json").write_text('{"weight_map": ')
    return {"argv": ["inspect", str(d)], "expect": ["model.safetensors.index.json", "not a valid shard index"]}


@case
def c_shard_escapes_directory(tmp: Path, base: Path) -> dict:
    d = _sharded(tmp, base)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["wte.weight"] = "../../etc/passwd"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return {"argv": ["inspect", str(d)], "expect": ["'../../etc/passwd'", "plain file name"]}


@case
def c_tensor_in_two_shards(tmp: Path, base: Path) -> dict:
    d = _sharded(tmp, base)
    rewrite(d / "model-00002-of-00002.safetensors", put={"h.0.ln_1.bias": torch.zeros(32)})
    return {"argv": ["inspect", str(d)], "expect": ["'h.0.ln_1.bias'", "also appears in", "model-00001-of-00002"]}


@case
def c_revision_for_local_path(tmp: Path, base: Path) -> dict:
    return {"argv": ["inspect", str(base), "--revision", "main"], "expect": ["--revision 'main'", "Hub ids only"]}


@case
def c_inspect_json_dir_missing(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["inspect", str(base), "--json", str(tmp / "no" / "such" / "r.json")],
        "expect": ["--json", "r.json", "does not exist"],
    }


# -- generate: arguments and inputs --------------------------------------------------------------------------------
def gen(base: Path, *extra: str, prompt: str = "Hello") -> list[str]:
    return ["generate", str(base), prompt, *extra]


@case
def c_gen_empty_prompt(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, prompt=""), "expect": ["PROMPT", "empty", "expected some text"]}


@case
def c_gen_prompt_longer_than_context(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--greedy", prompt=" the" * 40), "expect": ["PROMPT is 40 tokens", "context is 32"]}


@case
def c_gen_token_ids_out_of_range(tmp: Path, base: Path) -> dict:
    # The checkpoint's vocabulary has 1000 tokens; GPT-2's tokenizer gives " Paris" id 6342.
    return {"argv": gen(base, "--greedy", prompt=" Paris"), "expect": ["token id 6342", "out of range", "1000"]}


@case
def c_parity_token_ids_out_of_range(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--prompt", " Paris"], "expect": ["token id 6342", "vocabulary of 1000"]}


@case
def c_gen_zero_max_new_tokens(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--max-new-tokens", "0"), "expect": ["--max-new-tokens", "positive integer", "got 0"]}


@case
def c_gen_negative_max_new_tokens(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--max-new-tokens=-3"), "expect": ["--max-new-tokens", "positive integer", "got -3"]}


@case
def c_gen_zero_temperature(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--temperature", "0"), "expect": ["--temperature", "> 0", "got 0.0"]}


@case
def c_gen_negative_temperature(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--temperature=-0.5"), "expect": ["--temperature", "> 0", "got -0.5"]}


@case
def c_gen_top_p_zero(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--top-p", "0"), "expect": ["--top-p", "(0, 1]", "got 0.0"]}


@case
def c_gen_top_p_above_one(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--top-p", "1.5"), "expect": ["--top-p", "(0, 1]", "got 1.5"]}


@case
def c_gen_negative_top_k(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--top-k=-1"), "expect": ["--top-k", "non-negative", "got -1"]}


@case
def c_gen_greedy_with_temperature(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--greedy", "--temperature", "0.7"), "expect": ["--greedy", "--temperature"]}


@case
def c_gen_unknown_device(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--device", "tpu"), "expect": ["'tpu'", "unknown device", "cpu, cuda"]}


@case
def c_gen_cuda_without_cuda(tmp: Path, base: Path) -> dict:
    return {
        "argv": gen(base, "--device", "cuda"),
        "expect": ["'cuda'", "CUDA is not available", "--device cpu"],
        "no_cuda": True,
    }


@case
def c_gen_unknown_dtype(tmp: Path, base: Path) -> dict:
    expect = ["--dtype 'float8'", "float32, float16, bfloat16 or int8"]
    return {"argv": gen(base, "--dtype", "float8"), "expect": expect}


@case
def c_gen_json_dir_missing(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--json", str(tmp / "nodir" / "out.json")), "expect": ["--json", "does not exist"]}


@case
def c_gen_json_is_a_directory(tmp: Path, base: Path) -> dict:
    (tmp / "adir").mkdir()
    return {"argv": gen(base, "--json", str(tmp / "adir")), "expect": ["--json", "adir", "is a directory"]}


@case
def c_gen_bad_checkpoint(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    (d / "model.safetensors").write_bytes(b"\x00" * 7)
    return {"argv": gen(d, "--greedy"), "expect": ["model.safetensors", "7 bytes", "too short"]}


def nan_in_c_fc(tmp: Path, base: Path) -> Path:
    """A copy of the checkpoint with one NaN in h.0.mlp.c_fc.weight."""
    d = copy(base, tmp)
    st = SafetensorsFile(d / "model.safetensors")
    w = st.get("h.0.mlp.c_fc.weight").clone()
    del st
    w[3, 5] = float("nan")
    rewrite(d / "model.safetensors", put={"h.0.mlp.c_fc.weight": w})
    return d


@case
def c_gen_nan_weight(tmp: Path, base: Path) -> dict:
    d = nan_in_c_fc(tmp, base)
    # sampled (the default): multinomial would fail on NaN; ids of "a,b" (64, 11, 65) fit the 1000-token vocabulary
    return {
        "argv": gen(d, prompt="a,b"),
        "expect": ["logits of step 1", "NaN or Inf", "h.0.mlp.c_fc.weight", "expected finite"],
    }


@case
def c_gen_int8_nan_weight(tmp: Path, base: Path) -> dict:
    d = nan_in_c_fc(tmp, base)
    return {
        "argv": gen(d, "--quantize", "int8", prompt="a,b"),
        "expect": ["int8: non-finite weights", "h.0.mlp.c_fc.weight", "expected finite values"],
    }


@case
def c_gen_min_new_tokens_negative(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--min-new-tokens", "-1"), "expect": ["--min-new-tokens", "-1", ">= 0"]}


@case
def c_gen_temperature_overflows(tmp: Path, base: Path) -> dict:
    return {
        "argv": gen(base, "--temperature", "1e-40", "--seed", "1", prompt="a,b"),
        "expect": ["step 1", "temperature 1e-40", "turn finite logits into Inf", "expected a larger temperature"],
    }


@case
def c_parity_scratch_not_module_colon_function(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--scratch", "patch"], "expect": ["--scratch 'patch'", "MODULE:FUNCTION"]}


@case
def c_parity_scratch_file_missing(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--scratch", f"{tmp}/change.py:patch"],
        "expect": ["--scratch", "change.py:patch", "no file"],
    }


@case
def c_parity_scratch_raises(tmp: Path, base: Path) -> dict:
    (tmp / "change.py").write_text("def patch(model):\n    raise ValueError('not yet')\n")
    return {
        "argv": ["parity", str(base), "--ids", "1 2 3", "--scratch", f"{tmp}/change.py:patch"],
        "expect": ["the scratch change (--scratch) raised ValueError: not yet"],
    }


@case
def c_parity_fail_above_noise_without_floor(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--fail-above-noise", "--no-noise-floor"],
        "expect": ["--fail-above-noise", "not with --no-noise-floor"],
    }


@case
def c_parity_json_dir_missing(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--json", str(tmp / "nodir" / "p.json")],
        "expect": ["--json", "does not exist"],
    }


# -- parity inputs given as token ids, and outputs to stdout -----------------------------------------------------------
@case
def c_parity_ids_not_an_integer(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--ids", "464 x"], "expect": ["--ids '464 x'", "'x' is not a token id"]}


@case
def c_parity_ids_negative(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--ids", "3,-5"], "expect": ["--ids '3,-5'", "token id -5 is negative"]}


@case
def c_parity_ids_empty(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--ids", " , "], "expect": ["--ids", "no token ids"]}


@case
def c_parity_ids_outside_vocabulary(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--ids", "5 1000"],
        "expect": ["token-id prompt #1 (--ids, --ids-file)", "token id 1000", "vocabulary of 1000"],
    }


@case
def c_parity_ids_longer_than_context(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--ids", " ".join(["5"] * 40)], "expect": ["40 tokens", "context of 32"]}


@case
def c_parity_default_prompts_outside_vocabulary(tmp: Path, base: Path) -> dict:
    # The default prompts are stored GPT-2 ids; this checkpoint's vocabulary has 1000 tokens.
    return {"argv": ["parity", str(base)], "expect": ["The students opened their books", "token id 4721", "1000"]}


@case
def c_parity_ids_file_missing(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--ids-file", str(tmp / "no_ids.txt")],
        "expect": ["--ids-file", "no_ids.txt", "cannot read (No such file or directory)"],
    }


@case
def c_parity_prompt_file_not_utf8(tmp: Path, base: Path) -> dict:
    (tmp / "latin1.txt").write_bytes("café".encode("latin-1"))
    return {
        "argv": ["parity", str(base), "--prompt-file", str(tmp / "latin1.txt")],
        "expect": ["--prompt-file", "latin1.txt", "cannot read (not UTF-8 text:"],
    }


@case
def c_parity_ids_file_bad_line(tmp: Path, base: Path) -> dict:
    f = tmp / "ids.txt"
    f.write_text("5 6\n\n7 eight\n")
    return {"argv": ["parity", str(base), "--ids-file", str(f)], "expect": ["ids.txt line 3", "'eight'"]}


@case
def c_parity_json_and_markdown_both_stdout(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--json", "-", "--markdown", "-"],
        "expect": ["--json and --markdown", "stdout"],
    }


@case
def c_parity_plot_to_stdout(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--plot", "-"], "expect": ["--plot -", "file path"]}


# -- gpt2-port prepare -----------------------------------------------------------------------------------------------
def prep(tmp: Path, base: Path, *files: Path | str, out: Path | str | None = None, extra: tuple = ()) -> list[str]:
    """prepare's argv with the tokenizer files the base checkpoint carries; --out defaults to tmp/prepared."""
    out = tmp / "prepared" if out is None else out
    return ["prepare", *map(str, files), "--out", str(out), "--tokenizer", str(base), *extra]


def text_file(tmp: Path, name: str = "corpus.txt", data: bytes = b"First Citizen:\nBefore we proceed.\n") -> Path:
    (tmp / name).write_bytes(data)
    return tmp / name


@case
def c_prepare_not_utf8(tmp: Path, base: Path) -> dict:
    f = text_file(tmp, "latin1.txt", "caf\u00e9 au lait\n".encode() * 3 + "d\u00e9j\u00e0 vu\n".encode("latin-1"))
    return {
        "argv": prep(tmp, base, f),
        "expect": ["latin1.txt", "not UTF-8", "invalid byte 0xe9 at byte offset 43", "expected UTF-8"],
        "absent": [tmp / "prepared"],
    }


@case
def c_prepare_missing_file(tmp: Path, base: Path) -> dict:
    return {"argv": prep(tmp, base, text_file(tmp), tmp / "nope.txt"), "expect": ["nope.txt", "no such file"]}


@case
def c_prepare_directory_as_file(tmp: Path, base: Path) -> dict:
    (tmp / "texts").mkdir()
    return {"argv": prep(tmp, base, tmp / "texts"), "expect": ["texts", "is a directory", "UTF-8 text file"]}


@case
def c_prepare_fifo(tmp: Path, base: Path) -> dict:
    os.mkfifo(tmp / "pipe")  # opening it would block until a writer comes: it must be refused before that
    return {"argv": prep(tmp, base, tmp / "pipe"), "expect": ["pipe", "not a regular file", "read twice"]}


@case
def c_prepare_empty_corpus(tmp: Path, base: Path) -> dict:
    a, b = text_file(tmp, "a.txt", b""), text_file(tmp, "b.txt", b"")
    return {"argv": prep(tmp, base, a, b), "expect": ["a.txt", "b.txt", "empty corpus", "0 bytes"]}


@case
def c_prepare_val_fraction_zero(tmp: Path, base: Path) -> dict:
    return {
        "argv": prep(tmp, base, text_file(tmp), extra=("--val-fraction", "0")),
        "expect": ["--val-fraction", "(0, 1)", "got 0.0"],
    }


@case
def c_prepare_val_fraction_above_one(tmp: Path, base: Path) -> dict:
    return {
        "argv": prep(tmp, base, text_file(tmp), extra=("--val-fraction", "1.5")),
        "expect": ["--val-fraction", "(0, 1)", "got 1.5"],
    }


@case
def c_prepare_val_split_empty(tmp: Path, base: Path) -> dict:
    a, b = text_file(tmp, "a.txt"), text_file(tmp, "b.txt")
    return {
        "argv": prep(tmp, base, a, b),
        "expect": ["--val-fraction 0.1 of 2 documents", "none in val.bin", ">= 0.25"],
        "absent": [tmp / "prepared"],
    }


@case
def c_prepare_too_short_to_split(tmp: Path, base: Path) -> dict:
    f = text_file(tmp, "tiny.txt", b"H")  # int(1 * 0.9) = 0 characters for train
    return {
        "argv": prep(tmp, base, f),
        "expect": ["tiny.txt", "too few characters (1)", "--val-fraction 0.1", "train.bin would be empty"],
        "absent": [tmp / "prepared"],
    }


@case
def c_prepare_out_under_a_file(tmp: Path, base: Path) -> dict:
    f = text_file(tmp)
    return {"argv": prep(tmp, base, f, out=f / "out"), "expect": ["--out", "corpus.txt", "is a file, not a directory"]}


@case
def c_prepare_out_is_a_file(tmp: Path, base: Path) -> dict:
    f = text_file(tmp)
    return {"argv": prep(tmp, base, f, out=f), "expect": ["--out", "corpus.txt", "not a directory"]}


@case
def c_prepare_out_in_proc(tmp: Path, base: Path) -> dict:
    return {
        "argv": prep(tmp, base, text_file(tmp), out="/proc/gpt2-port-x"),
        "expect": ["--out /proc/gpt2-port-x", "cannot create directory"],
        "absent": [Path("/proc/gpt2-port-x")],
    }


@case
def c_prepare_tokenizer_dir_without_files(tmp: Path, base: Path) -> dict:
    (tmp / "tok").mkdir()
    argv = prep(tmp, base, text_file(tmp))
    argv[argv.index("--tokenizer") + 1] = str(tmp / "tok")
    return {"argv": argv, "expect": ["--tokenizer", "tok", "no vocab.json + merges.txt"]}


# -- output paths, tokenizer directories and model names (each "after" check gets the error line) ----------------------
def _stays_char_device(path: str) -> Callable[[str], None]:
    def check(line: str) -> None:
        import stat

        assert stat.S_ISCHR(os.stat(path).st_mode), f"{path} is no longer a character device"
        kept = line.split("the results are kept in ")[-1].strip()  # kept on purpose, outside tmp: tidy up here
        assert "the results are kept in " in line and Path(kept).is_file(), line
        Path(kept).unlink()

    return check


@case
def c_inspect_json_dev_full(tmp: Path, base: Path) -> dict:
    """The write fails after the work (a full device): one line, the results kept, the device untouched."""
    return {
        "argv": ["inspect", str(base), "--json", "/dev/full"],
        "expect": ["--json /dev/full", "cannot write", "No space left on device", "kept in"],
        "after": [_stays_char_device("/dev/full")],
    }


@case
def c_gen_json_proc(tmp: Path, base: Path) -> dict:
    """os.access says yes to root here; the early check creates a real file, which fails before the load."""
    return {"argv": gen(base, "--json", "/proc/out.json"), "expect": ["--json /proc/out.json", "cannot create a file"]}


@case
def c_inspect_json_under_a_file(tmp: Path, base: Path) -> dict:
    (tmp / "afile").write_text("x")
    return {
        "argv": ["inspect", str(base), "--json", str(tmp / "afile" / "r.json")],
        "expect": ["--json", "afile", "is not a directory"],
    }


@case
def c_inspect_json_socket(tmp: Path, base: Path) -> dict:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(tmp / "s.sock"))
    s.close()  # the socket file stays: a path that must be refused, not replaced
    return {
        "argv": ["inspect", str(base), "--json", str(tmp / "s.sock")],
        "expect": ["--json", "s.sock", "is a socket", "expected a regular file"],
    }


@case
def c_demo_out_proc(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["demo-checkpoint", "--out", "/proc/gpt2-demo"],
        "expect": ["--out /proc/gpt2-demo", "cannot create"],
    }


@case
def c_attention_png_proc(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["attention", str(base), "Hello", "--layer", "0", "--png", "/proc/a.png"],
        "expect": ["--png /proc/a.png", "cannot create a file in /proc"],
    }


@case
def c_gen_tokenizer_dir_without_files(tmp: Path, base: Path) -> dict:
    (tmp / "tok").mkdir()
    (tmp / "tok" / "vocab.json").write_text("{}")
    return {
        "argv": gen(base, "--tokenizer", str(tmp / "tok")),
        "expect": ["--tokenizer", "tok", "missing merges.txt"],
    }


@case
def c_eval_tokenizer_dir_without_files(tmp: Path, base: Path) -> dict:
    (tmp / "tok").mkdir()
    (tmp / "text.txt").write_text("To be, or not to be.\n")
    return {
        "argv": ev(base, tmp, "--text", str(tmp / "text.txt"), "--tokenizer", str(tmp / "tok")),
        "expect": ["--tokenizer", "tok", "missing vocab.json and merges.txt"],
    }


@case
def c_eval_tokenizer_not_a_directory(tmp: Path, base: Path) -> dict:
    (tmp / "text.txt").write_text("To be, or not to be.\n")
    return {
        "argv": ev(base, tmp, "--text", str(tmp / "text.txt"), "--tokenizer", str(tmp / "nowhere")),
        "expect": ["--tokenizer", "nowhere", "not a directory"],
    }


@case
def c_parity_tokenizer_dir_without_files(tmp: Path, base: Path) -> dict:
    (tmp / "tok").mkdir()
    return {
        "argv": ["parity", str(base), "--prompt", "hello there", "--tokenizer", str(tmp / "tok")],
        "expect": ["--tokenizer", "tok", "missing vocab.json and merges.txt"],
    }


@case
def c_path_typo_beside_a_directory(tmp: Path, base: Path) -> dict:
    (tmp / "weights" / "gpt2-random").mkdir(parents=True)
    return {
        "argv": ["inspect", str(tmp / "weights" / "gpt2-randon")],
        "expect": [
            "gpt2-randon: no such file or directory",
            "looks like a path",
            f"did you mean {tmp}/weights/gpt2-random?",
        ],
    }


@case
def c_model_name_close_to_an_official_id(tmp: Path, base: Path) -> dict:
    return {"argv": ["inspect", "gpt2-smal"], "expect": ["gpt2-smal", "not a Hub model id", "did you mean gpt2?"]}


# -- eval inputs and arguments -----------------------------------------------------------------------------------------
def ev(base: Path, tmp: Path, *extra: str) -> list[str]:
    return ["eval", str(base), *extra, "--json", str(tmp / "eval.json")]


def _text(tmp: Path, data: bytes = b"a a a a\nb b\n") -> Path:
    f = tmp / "in.txt"
    f.write_bytes(data)
    return f


@case
def c_eval_text_not_utf8(tmp: Path, base: Path) -> dict:
    f = _text(tmp, b"a a a\n\xff\xfe b")
    return {"argv": ev(base, tmp, "--text", str(f)), "expect": ["--text", "in.txt", "not UTF-8", "at byte offset 6"]}


@case
def c_eval_text_empty(tmp: Path, base: Path) -> dict:
    f = _text(tmp, b"")
    return {"argv": ev(base, tmp, "--text", str(f)), "expect": ["--text", "in.txt", "empty", "expected some"]}


@case
def c_eval_text_missing(tmp: Path, base: Path) -> dict:
    return {"argv": ev(base, tmp, "--text", str(tmp / "nope.txt")), "expect": ["--text", "nope.txt", "no such file"]}


@case
def c_eval_lambada_line_not_json(tmp: Path, base: Path) -> dict:
    f = tmp / "l.jsonl"
    f.write_text('{"text": "a b"}\n{"text": "a b"\n')
    return {"argv": ev(base, tmp, "--lambada", str(f)), "expect": ["--lambada", "l.jsonl", "line 2", "not valid JSON"]}


@case
def c_eval_lambada_line_without_text(tmp: Path, base: Path) -> dict:
    f = tmp / "l.jsonl"
    f.write_text('{"text": "a b"}\n\n{"txt": "a b"}\n')
    return {"argv": ev(base, tmp, "--lambada", str(f)), "expect": ["--lambada", "line 3", "no 'text' field"]}


@case
def c_eval_choices_line_without_endings(tmp: Path, base: Path) -> dict:
    f = tmp / "c.jsonl"
    f.write_text('{"ctx": "a", "label": 0}\n')
    return {"argv": ev(base, tmp, "--choices", str(f)), "expect": ["--choices", "line 1", "no 'endings' field"]}


@case
def c_eval_choices_label_outside_endings(tmp: Path, base: Path) -> dict:
    f = tmp / "c.jsonl"
    f.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{"ctx": "a", "endings": ["b", "c"], "label": 2}\n')
    return {
        "argv": ev(base, tmp, "--choices", str(f)),
        "expect": ["--choices", "line 2", "label 2 is outside the 2 endings", "0..1"],
    }


@case
def c_eval_choices_context_only_whitespace(tmp: Path, base: Path) -> dict:
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32)  # GPT-2's vocabulary: the tokens are encoded
    d = write_demo_checkpoint(tmp / "m", config=cfg, seed=4, tokenizer_dir=base)
    f = tmp / "c.jsonl"
    f.write_text('{"ctx": "a", "endings": ["b"], "label": 0}\n{"ctx": "  ", "endings": ["b", "c"], "label": 1}\n')
    return {"argv": ev(d, tmp, "--choices", str(f)), "expect": ["--choices", "line 2", "context is only whitespace"]}


@case
def c_eval_hellaswag_ending_only_markup(tmp: Path, base: Path) -> dict:
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32)
    d = write_demo_checkpoint(tmp / "m", config=cfg, seed=4, tokenizer_dir=base)
    row = {"activity_label": "A", "ctx_a": "b", "ctx_b": "c", "ctx": "b c", "endings": ["d", "[step]"], "label": "0"}
    f = tmp / "hs.jsonl"
    f.write_text(json.dumps(row) + "\n")
    return {"argv": ev(d, tmp, "--choices", str(f)), "expect": ["--choices", "line 1", "ending is empty", "markup"]}


@case
def c_eval_hellaswag_prompt_without_choices(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {
        "argv": ev(base, tmp, "--text", str(f), "--hellaswag-prompt", "raw"),
        "expect": ["--hellaswag-prompt raw", "--choices only"],
    }


@case
def c_eval_wikitext_with_stride(tmp: Path, base: Path) -> dict:
    f = _text(tmp, b" = A = \n b \n")
    return {"argv": ev(base, tmp, "--wikitext", str(f), "--stride", "8"), "expect": ["--stride", "--text only"]}


@case
def c_eval_wikitext_blank(tmp: Path, base: Path) -> dict:
    f = _text(tmp, b" \n \n")
    return {
        "argv": ev(base, tmp, "--wikitext", str(f)),
        "expect": ["--wikitext", "in.txt", "holds no text", "wiki.test.raw"],
    }


@case
def c_eval_wikitext_not_utf8(tmp: Path, base: Path) -> dict:
    f = _text(tmp, b" = A = \n\xff")
    return {
        "argv": ev(base, tmp, "--wikitext", str(f)),
        "expect": ["--wikitext", "in.txt", "not UTF-8", "byte offset 8"],
    }


@case
def c_eval_wikitext_pages_without_page(tmp: Path, base: Path) -> dict:
    f = tmp / "pages.jsonl"
    f.write_text('{"page": " = A = "}\n{"text": " = B = "}\n')
    return {"argv": ev(base, tmp, "--wikitext", str(f)), "expect": ["--wikitext", "line 2", "no 'page' field"]}


@case
def c_eval_wikitext_missing(tmp: Path, base: Path) -> dict:
    return {"argv": ev(base, tmp, "--wikitext", str(tmp / "wiki.test.raw")), "expect": ["--wikitext", "no such file"]}


@case
def c_eval_stride_larger_than_max_length(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {
        "argv": ev(base, tmp, "--text", str(f), "--max-length", "16", "--stride", "17"),
        "expect": ["--stride 17", "larger than --max-length 16"],
    }


@case
def c_eval_stride_zero(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {"argv": ev(base, tmp, "--text", str(f), "--stride", "0"), "expect": ["--stride", "positive", "got 0"]}


@case
def c_eval_stride_negative(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {"argv": ev(base, tmp, "--text", str(f), "--stride=-4"), "expect": ["--stride", "positive", "got -4"]}


@case
def c_eval_stride_larger_than_the_context(tmp: Path, base: Path) -> dict:
    f = _text(tmp)  # --max-length defaults to n_positions (32 here)
    return {"argv": ev(base, tmp, "--text", str(f), "--stride", "33"), "expect": ["--stride", "1..32", "got 33"]}


@case
def c_eval_max_length_over_the_context(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {"argv": ev(base, tmp, "--text", str(f), "--max-length", "64"), "expect": ["--max-length", "1..32", "64"]}


@case
def c_eval_vocab_without_endoftext(tmp: Path, base: Path) -> dict:
    f = _text(tmp)  # the base checkpoint has 1000 tokens: no <|endoftext|> (50256) for the first window's context
    return {"argv": ev(base, tmp, "--text", str(f)), "expect": ["vocabulary of 1000", "<|endoftext|> (50256)"]}


@case
def c_eval_nan_weight(tmp: Path, base: Path) -> dict:
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=32)  # GPT-2's full vocabulary, tiny otherwise
    d = write_demo_checkpoint(tmp / "nan", config=cfg, seed=4, tokenizer_dir=base)
    w = SafetensorsFile(d / "model.safetensors").get("h.1.mlp.c_fc.weight").clone()
    w[0, 0] = float("nan")
    rewrite(d / "model.safetensors", put={"h.1.mlp.c_fc.weight": w})
    f = _text(tmp)
    return {"argv": ev(d, tmp, "--text", str(f)), "expect": ["non-finite logits", "NaN/Inf in h.1.mlp.c_fc.weight"]}


@case
def c_eval_stride_without_text(tmp: Path, base: Path) -> dict:
    f = tmp / "l.jsonl"
    f.write_text('{"text": "a b"}\n')
    return {"argv": ev(base, tmp, "--lambada", str(f), "--stride", "8"), "expect": ["--stride", "--text only"]}


@case
def c_eval_no_noise_floor_without_check(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {"argv": ev(base, tmp, "--text", str(f), "--no-noise-floor"), "expect": ["--no-noise-floor", "--check"]}


@case
def c_eval_json_dir_missing(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {
        "argv": ["eval", str(base), "--text", str(f), "--json", str(tmp / "nodir" / "e.json")],
        "expect": ["--json", "does not exist"],
    }


@case
def c_parity_kernels_without_backward(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--kernels", "fast"], "expect": ["--kernels", "--backward"]}


@case
def c_backward_zero_train_steps(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--train-steps", "0"], "expect": ["--train-steps", "positive", "got 0"]}


@case
def c_backward_negative_train_steps(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--train-steps=-2"], "expect": ["--train-steps", "positive", "got -2"]}


@case
def c_backward_zero_lr(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--train-steps", "2", "--lr", "0"], "expect": ["--lr", "> 0", "got 0.0"]}


@case
def c_backward_with_sublayer_detail(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--backward", "--detail", "sublayer"],
        "expect": ["--detail sublayer", "not with --backward"],
    }


@case
def c_backward_int8_dtype(tmp: Path, base: Path) -> dict:
    # parity has no int8 model: the dtype is refused before anything loads (a model that cannot train)
    return {"argv": ["parity", str(base), "--backward", "--dtype", "int8"], "expect": ["dtype 'int8'", "float32"]}


@case
def c_backward_token_ids_out_of_range(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--backward", "--prompt", " Paris"],
        "expect": ["token id 6342", "vocabulary of 1000"],
    }


# -- train ------------------------------------------------------------------------------------------------------------
def _train_data(tmp: Path, ids: object = None) -> Path:
    import numpy as np

    d = tmp / "data"
    d.mkdir(exist_ok=True)
    np.array(list(range(900)) * 3 if ids is None else ids, dtype="<u2").tofile(d / "train.bin")
    np.array(list(range(100)) * 3, dtype="<u2").tofile(d / "val.bin")
    return d


def train_argv(base: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--init",
        str(base),
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "1",
        "--no-plot",
        "--batch-size",
        "1",
        "--block-size",
        "8",
        *extra,
    ]


@case
def c_train_data_without_train_bin(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    (d / "train.bin").unlink()
    return {"argv": train_argv(base, d, tmp / "out"), "expect": ["--data", "no train.bin", "gpt2-port prepare"]}


@case
def c_train_val_split_shorter_than_a_window(tmp: Path, base: Path) -> dict:
    """A tiny corpus's val.bin: the ways out named (a smaller --block-size, no val.bin, more text)."""
    import numpy as np

    d = _train_data(tmp)
    np.array([5, 6, 7, 8, 9, 10], dtype="<u2").tofile(d / "val.bin")
    expect = ["val.bin", "holds 6 tokens", "fewer than the 9", "--block-size of at most 5", "no val.bin", "more text"]
    return {"argv": train_argv(base, d, tmp / "out"), "expect": expect}


@case
def c_train_bin_id_outside_vocabulary(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp, [5] * 50 + [1000] + [7] * 50)  # the checkpoint's vocabulary has 1000 ids
    return {"argv": train_argv(base, d, tmp / "out"), "expect": ["train.bin", "token id 1000 at offset 50", "1000"]}


def _ids_as(dtype: str, n: int = 2000):  # noqa: ANN202
    import numpy as np

    return (np.arange(n) * 7 % 999 + 1).astype(dtype)  # ids 1..999, never 0 (the vocabulary has 1000)


@case
def c_train_bin_written_as_int32(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    _ids_as("<i4").tofile(d / "train.bin")  # np.array(ids).tofile(): numpy's default int, not uint16
    return {"argv": train_argv(base, d, tmp / "out"), "expect": ["train.bin", "int32", "not uint16", "uint16 ids"]}


@case
def c_train_bin_written_as_int64(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    _ids_as("<i8").tofile(d / "train.bin")
    return {"argv": train_argv(base, d, tmp / "out"), "expect": ["train.bin", "int64", "not uint16"]}


@case
def c_train_bin_written_as_float32(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    _ids_as("<f4").tofile(d / "train.bin")
    return {"argv": train_argv(base, d, tmp / "out"), "expect": ["train.bin", "float32", "not uint16"]}


@case
def c_train_bin_size_disagrees_with_meta_json(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    _ids_as("<i4", 900).tofile(d / "train.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "train_tokens": 900, "val_tokens": 300}))
    expect = ["train.bin", "3,600 bytes", "meta.json says 900 uint16 tokens", "4 bytes per token", "int32"]
    return {"argv": train_argv(base, d, tmp / "out"), "expect": expect}


@case
def c_eval_data_bin_written_as_int32(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    _ids_as("<i4").tofile(d / "val.bin")
    return {"argv": ["eval", str(base), "--data", str(d)], "expect": ["val.bin", "int32", "not uint16"]}


@case
def c_eval_data_val_bin_empty(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    (d / "val.bin").write_bytes(b"")
    return {"argv": ["eval", str(base), "--data", str(d)], "expect": ["val.bin", "holds 0 tokens", "more text"]}


@case
def c_eval_data_without_val_bin(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    (d / "val.bin").unlink()
    return {"argv": ["eval", str(base), "--data", str(d)], "expect": ["--data", "no val.bin", "gpt2-port prepare"]}


@case
def c_train_resume_with_moved_data(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    run = tmp / "run"
    assert main(train_argv(base, d, run, "--steps", "2", "--stop-at", "1")) == 0
    d.rename(tmp / "elsewhere")
    return {"argv": ["train", "--resume", str(run), "--no-plot"], "expect": ["--resume", "data directory", "is gone"]}


@case
def c_train_init_config_json_without_from_scratch(tmp: Path, base: Path) -> dict:
    argv = train_argv(base, _train_data(tmp), tmp / "out")
    argv[argv.index("--init") + 1] = str(base / "config.json")
    return {"argv": argv, "expect": ["--init", "config.json is not a checkpoint", "--from-scratch"]}


@case
def c_train_block_size_above_n_positions(tmp: Path, base: Path) -> dict:
    argv = train_argv(base, _train_data(tmp), tmp / "out")
    argv[argv.index("--block-size") + 1] = "33"
    return {"argv": argv, "expect": ["--block-size 33", "n_positions=32"]}


@case
def c_train_batch_size_zero(tmp: Path, base: Path) -> dict:
    argv = train_argv(base, _train_data(tmp), tmp / "out")
    argv[argv.index("--batch-size") + 1] = "0"
    return {"argv": argv, "expect": ["--batch-size", "positive integer", "got 0"]}


@case
def c_train_pad_vocab_zero(tmp: Path, base: Path) -> dict:
    argv = [*train_argv(base, _train_data(tmp), tmp / "out"), "--pad-vocab", "0"]
    return {"argv": argv, "expect": ["--pad-vocab", "positive integer", "got 0"]}


@case
def c_train_resume_from_another_model(tmp: Path, base: Path) -> dict:
    from gpt2_port.train import state as trainer_state

    other = GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32, vocab_size=1000)
    run = write_demo_checkpoint(tmp / "run", config=other, seed=1)
    trainer_state.save(
        trainer_state.TrainerState(
            step=1,
            model_config=other.to_hf_dict(),
            args={"steps": 1},
            world_size=1,
            batches_drawn=1,
            tensors={"rng.torch_cpu": torch.get_rng_state(), "rng.data": torch.Generator().get_state()},
        ),
        run,
    )
    argv = ["train", "--init", str(base), "--resume", str(run), "--data", str(_train_data(tmp)), "--steps", "2"]
    return {"argv": argv + ["--no-plot"], "expect": ["--resume", "trained another model", "n_layer=1", "2 here"]}


@case
def c_train_out_under_a_regular_file(tmp: Path, base: Path) -> dict:
    (tmp / "afile").write_text("x")
    argv = train_argv(base, _train_data(tmp), tmp / "afile" / "out")
    return {"argv": argv, "expect": ["--out", "afile", "is a file, not a directory"]}


@case
def c_train_out_unwritable_proc(tmp: Path, base: Path) -> dict:
    return {"argv": train_argv(base, _train_data(tmp), Path("/proc/x")), "expect": ["--out /proc/x", "cannot write"]}


# -- an output that is one of the command's inputs: refused before any work, the input left as it was ---------------
def _unchanged(*paths: Path) -> Callable[[str], None]:
    """An "after" check: each file still holds the bytes it held when the case was built."""
    before = {p: p.read_bytes() for p in paths}

    def check(line: str) -> None:
        for p, data in before.items():
            assert p.read_bytes() == data, f"{p} was written over"

    return check


@case
def c_inspect_json_is_the_weights(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    return {
        "argv": ["inspect", str(d), "--json", str(d / "model.safetensors")],
        "expect": ["--json", "model.safetensors", "is a file of MODEL", "would destroy it", "another path"],
        "after": [_unchanged(d / "model.safetensors")],
    }


@case
def c_gen_json_links_to_the_config(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    (tmp / "out.json").symlink_to(d / "config.json")  # written through, the link would replace the config
    return {
        "argv": gen(d, "--greedy", "--json", str(tmp / "out.json"), prompt="a,b"),
        "expect": ["--json", "out.json", "config.json", "is a file of MODEL"],
        "after": [_unchanged(d / "config.json")],
    }


@case
def c_gen_json_is_the_tokenizer(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    tok = find_files(d)[0]
    return {
        "argv": gen(base, "--json", str(tok), "--tokenizer", str(d), prompt="a,b"),
        "expect": ["--json", tok.name, "is a file of --tokenizer"],
        "after": [_unchanged(tok)],
    }


@case
def c_attention_png_is_the_weights(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    return {
        "argv": ["attention", str(d), "a,b", "--layer", "0", "--png", str(d / "model.safetensors")],
        "expect": ["--png", "model.safetensors", "is a file of MODEL"],
        "after": [_unchanged(d / "model.safetensors")],
    }


@case
def c_parity_json_is_the_weights_file_given_as_model(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = d / "model.safetensors"
    return {
        "argv": ["parity", str(f), "--ids", "1 2 3", "--json", str(f)],
        "expect": ["--json", "model.safetensors", "is a file of MODEL"],
        "after": [_unchanged(f)],
    }


@case
def c_parity_plot_is_the_config(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    return {
        "argv": ["parity", str(d), "--ids", "1 2 3", "--plot", str(d / "config.json")],
        "expect": ["--plot", "config.json", "is a file of MODEL"],
        "after": [_unchanged(d / "config.json")],
    }


@case
def c_parity_markdown_is_the_ids_file(tmp: Path, base: Path) -> dict:
    f = tmp / "ids.txt"
    f.write_text("1 2 3\n")
    return {
        "argv": ["parity", str(base), "--ids-file", str(f), "--markdown", str(f)],
        "expect": ["--markdown", "ids.txt", "is the --ids-file input"],
        "after": [_unchanged(f)],
    }


@case
def c_parity_json_and_plot_one_file(tmp: Path, base: Path) -> dict:
    return {
        "argv": ["parity", str(base), "--ids", "1 2 3", "--json", str(tmp / "r.out"), "--plot", str(tmp / "r.out")],
        "expect": ["--json", "--plot", "r.out", "the same file"],
    }


@case
def c_eval_json_is_the_text(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {
        "argv": ["eval", str(base), "--text", str(f), "--json", str(f)],
        "expect": ["--json", "in.txt", "is the --text input"],
        "after": [_unchanged(f)],
    }


@case
def c_eval_markdown_is_the_weights(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    f = _text(tmp)
    return {
        "argv": ["eval", str(d), "--text", str(f), "--markdown", str(d / "model.safetensors")],
        "expect": ["--markdown", "model.safetensors", "is a file of MODEL"],
        "after": [_unchanged(d / "model.safetensors")],
    }


@case
def c_eval_json_is_the_splits_meta_json(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "train_tokens": 2700, "val_tokens": 300}))
    return {
        "argv": ["eval", str(base), "--data", str(d), "--json", str(d / "meta.json")],
        "expect": ["--json", "meta.json", "is a file of --data"],
        "after": [_unchanged(d / "meta.json")],
    }


@case
def c_eval_json_and_markdown_one_file(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    out = tmp / "r.out"
    return {
        "argv": ["eval", str(base), "--text", str(f), "--json", str(out), "--markdown", str(out)],
        "expect": ["--json", "--markdown", "r.out", "the same file"],
    }


@case
def c_prepare_out_holds_the_input_train_bin(tmp: Path, base: Path) -> dict:
    d = tmp / "prepared"
    d.mkdir()
    f = text_file(d, "train.bin")  # text that happens to be named like the output
    return {
        "argv": prep(tmp, base, f, out=d),
        "expect": ["--out", "writes train.bin there", "the TEXT_FILE input", "another directory"],
        "after": [_unchanged(f)],
    }


@case
def c_prepare_out_holds_the_input_meta_json(tmp: Path, base: Path) -> dict:
    d = tmp / "prepared"
    d.mkdir()
    f = text_file(d, "meta.json")
    return {
        "argv": prep(tmp, base, text_file(tmp), f, out=d),
        "expect": ["--out", "writes meta.json there", "the TEXT_FILE input"],
        "after": [_unchanged(f)],
    }


@case
def c_train_out_is_the_init_checkpoint(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    return {
        "argv": train_argv(d, _train_data(tmp), d),
        "expect": ["--out", "writes model.safetensors there", "a file of --init"],
        "after": [_unchanged(d / "model.safetensors", d / "config.json")],
    }


@case
def c_train_out_holds_another_checkpoint(tmp: Path, base: Path) -> dict:
    other = copy(base, tmp, "other")
    return {
        "argv": train_argv(base, _train_data(tmp), other),
        "expect": ["--out", "other", "holds a checkpoint already (model.safetensors)", "another --out"],
        "after": [_unchanged(other / "model.safetensors")],
    }


@case
def c_train_json_is_its_own_trainer_state(tmp: Path, base: Path) -> dict:
    run = _saved_run(tmp, base)
    f = run / "trainer_state.json"
    return {
        "argv": ["train", "--resume", str(run), "--steps", "3", "--no-plot", "--json", str(f)],
        "expect": ["--json", "trainer_state.json", "is a file of --resume"],
        "after": [_unchanged(f, run / "log.jsonl")],
    }


@case
def c_train_json_in_its_out_dir(tmp: Path, base: Path) -> dict:
    out = tmp / "out"
    return {
        "argv": train_argv(base, _train_data(tmp), out, "--json", str(out / "log.jsonl")),
        "expect": ["--json", "log.jsonl", "is a file the run writes in --out"],
    }


@case
def c_train_json_is_the_train_bin(tmp: Path, base: Path) -> dict:
    d = _train_data(tmp)
    return {
        "argv": train_argv(base, d, tmp / "out", "--json", str(d / "train.bin")),
        "expect": ["--json", "train.bin", "is a file of --data"],
        "after": [_unchanged(d / "train.bin")],
    }


@case
def c_demo_out_holds_a_checkpoint(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    return {
        "argv": ["demo-checkpoint", "--out", str(d)],
        "expect": ["--out", "holds a checkpoint already (model.safetensors)", "random weights would replace"],
        "after": [_unchanged(d / "model.safetensors", d / "config.json")],
    }


# -- seeds out of range, and writes that fail after the work -----------------------------------------------------------
HUGE_SEED = "99999999999999999999"


@case
def c_gen_seed_too_large(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--seed", HUGE_SEED), "expect": ["--seed", "0..9223372036854775807", HUGE_SEED]}


@case
def c_gen_seed_negative(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--seed=-1"), "expect": ["--seed", "0..9223372036854775807", "got -1"]}


@case
def c_train_seed_too_large(tmp: Path, base: Path) -> dict:
    argv = train_argv(base, _train_data(tmp), tmp / "out", "--seed", HUGE_SEED)
    return {"argv": argv, "expect": ["--seed", "0..9223372036854775807", HUGE_SEED]}


@case
def c_demo_seed_too_large(tmp: Path, base: Path) -> dict:
    argv = ["demo-checkpoint", "--out", str(tmp / "demo"), "--seed", HUGE_SEED]
    return {"argv": argv, "expect": ["--seed", "0..9223372036854775807", HUGE_SEED]}


# -- a trainer_state.json with values of the wrong type or range: refused when read, before anything is written ----
def _saved_run(tmp: Path, base: Path) -> Path:
    run = tmp / "run"
    assert main(train_argv(base, _train_data(tmp), run, "--steps", "2", "--stop-at", "1", "--no-progress")) == 0
    return run


def _broken_state(tmp: Path, base: Path, change: Callable[[dict], None]) -> tuple[Path, Callable[[str], None]]:
    run = _saved_run(tmp, base)
    f = run / "trainer_state.json"
    meta = json.loads(f.read_text())
    change(meta)
    f.write_text(json.dumps(meta))
    return run, _unchanged(f, run / "log.jsonl", run / "model.safetensors")


def _resume(run: Path) -> list[str]:
    return ["train", "--resume", str(run), "--steps", "3", "--no-plot"]


@case
def c_train_state_negative_step(tmp: Path, base: Path) -> dict:
    run, same = _broken_state(tmp, base, lambda m: m.update(step=-1))
    expect = ["trainer_state.json", "step", "non-negative integer", "got -1"]
    return {"argv": _resume(run), "expect": expect, "after": [same]}


@case
def c_train_state_step_as_text(tmp: Path, base: Path) -> dict:
    run, same = _broken_state(tmp, base, lambda m: m.update(step="1"))
    return {"argv": _resume(run), "expect": ["trainer_state.json", "step", "got '1'"], "after": [same]}


@case
def c_train_state_data_not_a_path(tmp: Path, base: Path) -> dict:
    run, same = _broken_state(tmp, base, lambda m: m["args"].update(data=5))
    expect = ["trainer_state.json", "args.data", "a directory path", "got 5"]
    return {"argv": _resume(run), "expect": expect, "after": [same]}


@case
def c_train_state_batch_size_as_text(tmp: Path, base: Path) -> dict:
    run, same = _broken_state(tmp, base, lambda m: m["args"].update(batch_size="8"))
    expect = ["trainer_state.json", "args.batch_size", "positive integer", "got '8'"]
    return {"argv": _resume(run), "expect": expect, "after": [same]}


@case
def c_train_state_lr_as_text(tmp: Path, base: Path) -> dict:
    run, same = _broken_state(tmp, base, lambda m: m["args"].update(lr="fast"))
    return {"argv": _resume(run), "expect": ["trainer_state.json", "args.lr", "a number", "'fast'"], "after": [same]}


@case
def c_train_state_best_step_after_step(tmp: Path, base: Path) -> dict:
    run, same = _broken_state(tmp, base, lambda m: m.update(best_step=9))
    return {"argv": _resume(run), "expect": ["trainer_state.json", "best_step 9", "after step 1"], "after": [same]}


# -- a tokenizer named for training: read before the run, not at its first save -------------------------------------
@case
def c_train_tokenizer_missing(tmp: Path, base: Path) -> dict:
    argv = train_argv(base, _train_data(tmp), tmp / "out", "--steps", "3", "--tokenizer", str(tmp / "nonexist"))
    return {"argv": argv, "expect": ["--tokenizer", "nonexist", "not a directory"], "absent": [tmp / "out"]}


@case
def c_train_tokenizer_dir_without_files(tmp: Path, base: Path) -> dict:
    (tmp / "tok").mkdir()
    argv = train_argv(base, _train_data(tmp), tmp / "out", "--tokenizer", str(tmp / "tok"))
    return {"argv": argv, "expect": ["--tokenizer", "tok", "missing vocab.json and merges.txt"]}


# -- generate: a batch that cannot fit in memory -----------------------------------------------------------------------
@case
def c_gen_num_samples_beyond_memory(tmp: Path, base: Path) -> dict:
    # 10^8 samples of the 1000-token vocabulary: about 2 TB of next-token scores alone
    return {
        "argv": gen(base, "--max-new-tokens", "2", "--num-samples", "100000000", prompt="a,b"),
        "expect": ["memory: 100000000 sample(s)", "next-token scores", "is available", "try --num-samples"],
    }


# -- flags that would be ignored, values out of range, messages -------------------------------------------------------
@case
def c_eval_json_and_markdown_both_stdout(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {
        "argv": ["eval", str(base), "--text", str(f), "--json", "-", "--markdown", "-"],
        "expect": ["--json and --markdown", "stdout"],
    }


@case
def c_eval_text_is_a_directory(tmp: Path, base: Path) -> dict:
    (tmp / "texts").mkdir()
    return {"argv": ev(base, tmp, "--text", str(tmp / "texts")), "expect": ["--text", "texts", "is a directory"]}


@case
def c_eval_text_dev_null(tmp: Path, base: Path) -> dict:
    return {"argv": ev(base, tmp, "--text", "/dev/null"), "expect": ["--text /dev/null", "not a regular file"]}


@case
def c_eval_lambada_is_a_directory(tmp: Path, base: Path) -> dict:
    (tmp / "l").mkdir()
    return {"argv": ev(base, tmp, "--lambada", str(tmp / "l")), "expect": ["--lambada", "is a directory"]}


@case
def c_eval_split_without_data(tmp: Path, base: Path) -> dict:
    f = _text(tmp)
    return {
        "argv": ev(base, tmp, "--text", str(f), "--split", "train"),
        "expect": ["--split train", "--data only"],
    }


@case
def c_parity_lr_without_train_steps(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--lr", "0.1"], "expect": ["--lr", "--train-steps"]}


@case
def c_backward_clip_without_train_steps(tmp: Path, base: Path) -> dict:
    return {"argv": ["parity", str(base), "--backward", "--clip", "2"], "expect": ["--clip", "--train-steps"]}


@case
def c_train_stop_at_after_steps(tmp: Path, base: Path) -> dict:
    argv = train_argv(base, _train_data(tmp), tmp / "out", "--stop-at", "5")
    return {"argv": argv, "expect": ["--stop-at", "at most --steps 1", "got 5"]}


@case
def c_train_resume_stop_at_a_step_already_done(tmp: Path, base: Path) -> dict:
    run = _saved_run(tmp, base)
    return {
        "argv": ["train", "--resume", str(run), "--stop-at", "1", "--no-plot"],
        "expect": ["--stop-at 1", "at step 1 already", "a later step"],
        "after": [_unchanged(run / "trainer_state.json", run / "log.jsonl")],
    }


@case
def c_train_resume_a_run_that_has_done_its_steps(tmp: Path, base: Path) -> dict:
    run = tmp / "run"
    assert main(train_argv(base, _train_data(tmp), run, "--steps", "2", "--no-progress")) == 0
    return {
        "argv": ["train", "--resume", str(run), "--no-plot"],
        "expect": [f"--resume {run}", "has done its 2 steps already", "--steps N with N > 2"],
        "after": [_unchanged(run / "trainer_state.json", run / "log.jsonl")],
    }


@case
def c_train_resume_with_steps_below_the_saved_step(tmp: Path, base: Path) -> dict:
    run = tmp / "run"
    assert main(train_argv(base, _train_data(tmp), run, "--steps", "3", "--stop-at", "2", "--no-progress")) == 0
    return {
        "argv": ["train", "--resume", str(run), "--steps", "1", "--no-plot"],
        "expect": ["--steps 1", str(run), "already at step 2"],
        "after": [_unchanged(run / "trainer_state.json", run / "log.jsonl")],
    }


def test_steps_below_the_saved_step_is_refused_before_any_warning(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal is the one line: no warning first about the schedule a run that will not start would follow."""
    spec = CASES["train_resume_with_steps_below_the_saved_step"](tmp_path, base)
    capsys.readouterr()
    assert main(spec["argv"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


@case
def c_prepare_out_empty(tmp: Path, base: Path) -> dict:
    return {"argv": prep(tmp, base, text_file(tmp), out=""), "expect": ["--out ''", "empty path", "directory"]}


@case
def c_attention_png_empty(tmp: Path, base: Path) -> dict:
    argv = ["attention", str(base), "a,b", "--layer", "0", "--png", ""]
    return {"argv": argv, "expect": ["--png ''", "empty path", "file path"]}


@case
def c_attention_text_outside_vocabulary(tmp: Path, base: Path) -> dict:
    # GPT-2's tokenizer on a model of 1,000 tokens: refused on the host before the forward (a GPU would not check)
    argv = ["attention", str(base), "Hello world", "--layer", "0", "--png", str(tmp / "a.png")]
    return {"argv": argv, "expect": ["TEXT: token id 15496", "vocabulary of 1000", "--tokenizer"]}


@case
def c_demo_out_empty(tmp: Path, base: Path) -> dict:
    return {"argv": ["demo-checkpoint", "--out", ""], "expect": ["--out ''", "empty path"]}


@case
def c_gen_temperature_inf(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--temperature", "inf"), "expect": ["--temperature", "finite", "got inf"]}


@case
def c_gen_device_cpu_with_an_index(tmp: Path, base: Path) -> dict:
    return {"argv": gen(base, "--device", "cpu:1"), "expect": ["'cpu:1'", "no index but 0"]}


def _named_once(name: str) -> Callable[[str], None]:
    def check(line: str) -> None:
        assert line.count(name) == 1, line

    return check


@case
def c_config_missing_key(tmp: Path, base: Path) -> dict:
    d = copy(base, tmp)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["n_embd"]
    (d / "config.json").write_text(json.dumps(cfg))
    return {
        "argv": ["inspect", str(d)],
        "expect": ["config.json", "missing required key 'n_embd'"],
        "after": [_named_once("config.json")],
    }


def _files(root: Path) -> set[str]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            out.add(os.path.relpath(os.path.join(dirpath, n), root))
    return out


def check_error(rc: int, err: str, expect: list[str]) -> str:
    """Exit 2, no traceback, and one error line (the last; any other line is a log line) naming the culprit."""
    assert rc == 2, f"exit code {rc}, stderr: {err}"
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert err.endswith("\n") and lines, err
    line = lines[-1]
    assert line.startswith("gpt2-port ") and ": error: " in line, line
    assert all(ln.startswith(("WARNING ", "INFO ")) for ln in lines[:-1]), err
    for s in expect:
        assert s in line, f"{s!r} not in {line!r}"
    return line


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(
    name: str, base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = CASES[name](tmp_path, base)
    argv = list(spec["argv"])
    report = tmp_path / "report.json"
    if argv[0] in ("inspect", "generate", "parity") and "--json" not in argv:
        argv += ["--json", str(report)]
    if spec.get("no_cuda"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = _files(tmp_path)
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    line = check_error(rc, err, spec["expect"])
    assert _files(tmp_path) == before, "files left behind"
    assert not report.exists()
    for p in spec.get("absent", []):
        assert not p.exists(), f"{p} exists: code from the file ran"
    for after in spec.get("after", []):
        after(line)


def _full_vocab_checkpoint(tmp: Path) -> Path:
    """A 1-layer checkpoint with GPT-2's vocabulary (eval needs <|endoftext|> as the first token's context)."""
    return write_demo_checkpoint(tmp / "full_vocab", config=GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=32))


# Outputs whose write fails after the work (/dev/full): (argv, the option, whether the results are kept in a file)
WRITE_FAILS = {
    "eval_json": (lambda tmp, base: ["eval", str(_full_vocab_checkpoint(tmp)), "--text", str(_text(tmp))], "--json"),
    "eval_markdown": (
        lambda tmp, base: ["eval", str(_full_vocab_checkpoint(tmp)), "--text", str(_text(tmp))],
        "--markdown",
    ),
    "parity_json": (lambda tmp, base: ["parity", str(base), "--ids", "1 2 3"], "--json"),
    "parity_markdown": (lambda tmp, base: ["parity", str(base), "--ids", "1 2 3"], "--markdown"),
    "parity_plot": (lambda tmp, base: ["parity", str(base), "--ids", "1 2 3"], "--plot"),
}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="/dev/full is Linux only")
@pytest.mark.parametrize("name", sorted(WRITE_FAILS))
def test_write_that_fails_after_the_work(
    name: str, base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full device met after the work (the early check passes on /dev/full): exit 2 and one line naming the option
    and the reason, the text and JSON results kept in a file named there (a PNG is not kept), the device untouched.
    These commands print timings on stderr before their outputs are written, so the error is the last line."""
    build, opt = WRITE_FAILS[name]
    argv = [*build(tmp_path, base), opt, "/dev/full"]
    before = _files(tmp_path)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.splitlines()[-1]
    assert line.startswith(f"gpt2-port {argv[0]}: error: {opt} /dev/full: cannot write (No space left on device)")
    if opt == "--plot":
        assert "kept in" not in line
    else:
        _stays_char_device("/dev/full")(line)
    assert _files(tmp_path) == before


def test_catalogue_size() -> None:
    assert len(CASES) >= 25


@pytest.mark.parametrize("name", ["header_not_json", "bin_pickle_runs_code", "gen_top_p_above_one"])
def test_bad_input_real_process(name: str, base: Path, tmp_path: Path) -> None:
    """The same cases through the console entry point in a real process: the real exit code and stderr."""
    spec = CASES[name](tmp_path, base)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    before = _files(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "gpt2_port", *spec["argv"], "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )
    check_error(r.returncode, r.stderr, spec["expect"])
    assert r.stdout == ""
    assert _files(tmp_path) == before
    for p in spec.get("absent", []):
        assert not p.exists()


def test_argparse_errors_are_one_line_exit_2(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", str(base), "x", "--max-new-tokens", "many"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "--max-new-tokens" in err and "'many'" in err


def test_internal_error_exit_3_with_hint(
    base: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected exception is not dressed up as bad input: exit 3, one line, a hint to report it."""
    import gpt2_port.io.load as load

    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise ZeroDivisionError("simulated bug")

    real = load.read_checkpoint
    monkeypatch.setattr(load, "read_checkpoint", boom)
    monkeypatch.delenv("GPT2_PORT_DEBUG", raising=False)
    rc = main(["inspect", str(base)])
    err = capsys.readouterr().err
    assert rc == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert "internal error" in err and "ZeroDivisionError" in err and "report" in err and "GPT2_PORT_DEBUG=1" in err
    monkeypatch.setenv("GPT2_PORT_DEBUG", "1")
    with pytest.raises(ZeroDivisionError):
        main(["inspect", str(base)])
    monkeypatch.setattr(load, "read_checkpoint", real)
    capsys.readouterr()
    assert main(["inspect", str(base / "missing")]) == 2  # bad input stays its one line under GPT2_PORT_DEBUG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpt2-port inspect: error: ") and "missing" in err, err


def test_atomic_write_never_leaves_a_half_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way leaves the old file intact and no temporary file behind."""
    from gpt2_port import files as util

    target = tmp_path / "out.json"
    target.write_text("old\n")

    class Boom(OSError):
        pass

    real_fdopen = os.fdopen

    def half_then_fail(fd, mode="r", *a, **k):  # type: ignore[no-untyped-def]
        f = real_fdopen(fd, mode, *a, **k)
        real_write = f.write

        def write(data):  # type: ignore[no-untyped-def]
            real_write(data[: len(data) // 2])
            raise Boom("disk full")

        f.write = write
        return f

    monkeypatch.setattr(util.os, "fdopen", half_then_fail)
    with pytest.raises(Boom):
        util.atomic_write_text(target, '{"a": 1}\n' * 1000)
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_generate_library_rejects_out_of_range_ids(base: Path) -> None:
    from gpt2_port.errors import UsageError
    from gpt2_port.generate import generate
    from gpt2_port.model import from_pretrained

    model, _ = from_pretrained(base)
    for ids, msg in (([[5, 1000]], "token id 1000"), ([[-1]], "token id -1"), ([[]], "empty prompt")):
        with pytest.raises(UsageError, match=msg.replace("(", r"\(")):
            generate(model, torch.tensor(ids, dtype=torch.long).reshape(len(ids), -1), 3)


def test_inspect_check_finite_names_all_and_loader_reports(base: Path, tmp_path: Path) -> None:
    """--check-finite finds every non-finite tensor (not just the first), and from_pretrained(check_finite=True)
    reports them by name without failing the load."""
    from gpt2_port.model import from_pretrained

    d = copy(base, tmp_path)
    st = SafetensorsFile(d / "model.safetensors")
    put = {}
    for k in ("wpe.weight", "h.1.attn.c_proj.weight", "h.0.ln_2.weight"):
        t = st.get(k).clone()
        t.view(-1)[-1] = float("inf")
        put[k] = t
    del st
    rewrite(d / "model.safetensors", put=put)
    _, rep = from_pretrained(d, check_finite=True)
    assert sorted(rep.nonfinite) == sorted(["wpe.weight", "h.1.attn.c_proj.weight", "h.0.ln_2.weight"])


def test_parity_report_always_lists_nonfinite_weights(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No flag needed: a NaN in the weights shows in the parity report (text and JSON) and fails it (exit 1)."""
    d = copy(base, tmp_path)
    st = SafetensorsFile(d / "model.safetensors")
    t = st.get("h.1.mlp.c_proj.weight").clone()
    del st
    t[0, 0] = float("nan")
    rewrite(d / "model.safetensors", put={"h.1.mlp.c_proj.weight": t})
    report = tmp_path / "p.json"
    rc = main(["parity", str(d), "--prompt", " the of and", "--json", str(report)])  # ids < the 1000-token vocab
    out, err = capsys.readouterr()
    assert rc == 1, err
    assert "NaN/Inf in weights" in out and "h.1.mlp.c_proj.weight" in out
    assert "h.1.mlp.c_proj.weight" in json.loads(report.read_text())["nonfinite_weights"]
