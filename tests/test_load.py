"""The loader: every layout found in the wild, dtype/device options, meta-device + zero-copy assignment."""

import gc
import json
import os
import shutil
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import TINY, hide_cuda, save_hf

from gpt2_port import GPT2
from gpt2_port.devices import parse_device, parse_dtype
from gpt2_port.errors import CheckpointError, UsageError
from gpt2_port.io.checkpoint import locate
from gpt2_port.io.load import read_checkpoint
from gpt2_port.model import from_pretrained

pytestmark = pytest.mark.exactness  # compares arithmetic: run again under a second configuration

IDS = torch.tensor([[464, 2444, 4721, 511, 3835], [464, 3797, 26172, 262, 10211]])


def logits(path, **kw) -> torch.Tensor:
    m = GPT2.from_pretrained(str(path), **kw)
    with torch.no_grad():
        return m(IDS)


def test_official_layout_loads_zero_copy(tiny_official: Path):
    model, rep = from_pretrained(tiny_official)
    assert rep.checkpoint.fmt == "safetensors" and rep.config == TINY
    assert len(rep.conversion.dropped) == TINY.n_layer  # one causal-mask buffer per layer
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    assert "lm_head.weight" not in params and model.head_weight is model.wte.weight  # tied: one tensor
    # Q is a transposed view into c_attn's storage (memory-mapped), not a copy
    q = model.h[0].attn.q_proj.weight
    k = model.h[0].attn.k_proj.weight
    assert not q.is_contiguous() and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert not model.training and not q.requires_grad


def test_both_layouts_same_logits(tiny_official: Path, tiny_hf: Path, tmp_path: Path):
    """The official layout and save_pretrained's layout of the same weights load to the same model."""
    from safetensors.torch import save_file

    from gpt2_port.io.adapter import scratch_to_hf

    model = GPT2.from_pretrained(str(tiny_official))
    save_file(scratch_to_hf(model.state_dict(), TINY), tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(tiny_official / "config.json", tmp_path / "config.json")
    assert torch.equal(logits(tiny_official), logits(tmp_path))
    assert logits(tiny_hf).shape == (2, 5, 50257)


def test_single_file_and_no_config(tiny_official: Path, tmp_path: Path):
    f = tmp_path / "weights.safetensors"
    shutil.copy(tiny_official / "model.safetensors", f)
    # no config.json beside it: inferred from the shapes (head count from head_dim 64 -> needs n_embd multiple of 64)
    ck = locate(f)
    assert ck.config_file is None and ck.weight_files == [f.resolve()]
    _, rep = read_checkpoint(f)
    assert (rep.config.n_layer, rep.config.n_embd, rep.config.n_positions) == (2, 64, 128)
    assert rep.config.n_head == 1  # 64 / 64: inference is a guess; a config.json beside the file wins
    shutil.copy(tiny_official / "config.json", tmp_path / "config.json")
    assert torch.equal(logits(f), logits(tiny_official))


def test_sharded_checkpoint(tmp_path: Path):
    d = save_hf(tmp_path / "sharded", TINY, seed=5)
    single = logits(d)
    # re-save sharded with transformers itself
    from transformers import GPT2LMHeadModel

    m = GPT2LMHeadModel.from_pretrained(d)
    out = tmp_path / "shards"
    m.save_pretrained(out, max_shard_size="2MB")
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1
    ck = locate(out)
    assert len(ck.weight_files) > 1
    assert torch.equal(logits(out), single)


def test_pytorch_bin_weights_only(tmp_path: Path, tiny_hf: Path):
    from safetensors.torch import load_file

    sd = load_file(tiny_hf / "model.safetensors")
    d = tmp_path / "bin"
    d.mkdir()
    n = TINY.n_positions
    sd.update({f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(TINY.n_layer)})
    sd.update(
        {f"transformer.h.{i}.attn.bias": torch.tril(torch.ones(n, n)).view(1, 1, n, n) for i in range(TINY.n_layer)}
    )
    torch.save(sd, d / "pytorch_model.bin")
    shutil.copy(tiny_hf / "config.json", d / "config.json")
    assert locate(d).fmt == "bin"
    assert torch.equal(logits(d), logits(tiny_hf))


def test_untied_head(tiny_hf_untied: Path):
    model, rep = from_pretrained(tiny_hf_untied)
    assert model.lm_head is not None and model.head_weight is not model.wte.weight
    assert not torch.equal(model.head_weight, model.wte.weight)
    from transformers import GPT2LMHeadModel

    ref = GPT2LMHeadModel.from_pretrained(tiny_hf_untied, attn_implementation="eager").eval()
    model.set_attn_impl("manual")
    with torch.no_grad():
        # batched attention matmuls may differ from the reference's in the last bit (strided vs contiguous q/k/v)
        torch.testing.assert_close(model(IDS), ref(IDS).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reduced_precision(tiny_official: Path, dtype: str):
    m = GPT2.from_pretrained(str(tiny_official), dtype=dtype)
    assert all(p.dtype == parse_dtype(dtype) for p in m.parameters())
    with torch.no_grad():
        out = m(IDS).float()
    ref = logits(tiny_official)
    assert (out - ref).norm() / ref.norm() < 3e-2


def test_dtype_and_device_errors():
    with pytest.raises(UsageError, match="unknown dtype 'float8'"):
        parse_dtype("float8")
    with pytest.raises(UsageError, match="unknown device 'tpu'"):
        parse_device("tpu")
    with pytest.raises(UsageError, match="CUDA is not available"):  # a CPU test sees no CUDA (conftest)
        parse_device("cuda")
    assert parse_device("auto").type in ("cpu", "mps")


def test_a_cpu_test_runs_on_the_cpu_where_a_gpu_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """conftest.hide_cuda, which each test not marked `cuda` gets where CUDA is: `auto` picks the CPU again, and the
    commands a test starts see no device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert parse_device("auto").type == "cuda"
    hide_cuda(monkeypatch)
    assert parse_device("auto").type in ("cpu", "mps") and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_missing_and_empty(tmp_path: Path):
    with pytest.raises(CheckpointError, match="no such file or directory"):
        locate(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no weights found"):
        locate(tmp_path)


_FILE_RSS = """
import sys
import weakref
from pathlib import Path
import torch
from gpt2_port.model import from_pretrained

def file_rss_kb(path):
    total, mine = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line ("start-end perms ...")
            mine = len(head) >= 6 and line.rstrip().endswith(str(path))
        elif mine and line.startswith("Rss:"):
            total += int(head[1])
    return total

f = Path(sys.argv[1]) / "model.safetensors"
model, report = from_pretrained(sys.argv[1])
after_load = file_rss_kb(f)
with torch.inference_mode():
    model(torch.tensor([[464, 2444]]))
print(after_load, file_rss_kb(f), len(report.conversion.dropped))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_checked_mask_buffers_leave_the_rss(ckpt124: Path):
    """The official file's 12 causal masks (48 MB) are read to be checked, then their pages are dropped: after the
    load and after a forward, the file's resident pages are at most the weights', never weights + masks."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FILE_RSS, str(ckpt124)], capture_output=True, text=True, check=True
    ).stdout.split()
    after_load, after_forward, dropped = (int(x) for x in out)
    mask_kb = 12 * 1024 * 1024 * 4 // 1024  # 12 layers x (1024 x 1024) float32
    assert dropped == 12
    weights_kb = (ckpt124 / "model.safetensors").stat().st_size // 1024 - mask_kb
    assert after_load < weights_kb + mask_kb // 4  # at most the weights (mapped in when the file is warm); no masks
    assert weights_kb * 0.95 < after_forward < weights_kb + mask_kb // 4  # the weights, resident; no masks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore/madvise: Linux")
def test_resident_fraction_and_prefetch(tiny_official: Path, tmp_path: Path):
    """prefetch asks the page cache (mincore on sampled pages) whether the file is warm: populate when it is, read-
    ahead advice when not; either way the loaded model is the same."""
    import os

    from gpt2_port.io.safetensors_io import SafetensorsFile

    f = tmp_path / "model.safetensors"
    shutil.copy(tiny_official / "model.safetensors", f)
    shutil.copy(tiny_official / "config.json", tmp_path / "config.json")
    f.read_bytes()  # warm
    sf = SafetensorsFile(f)
    assert sf.resident_fraction() == 1.0
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cold = SafetensorsFile(f).resident_fraction()
    assert cold is not None and 0.0 <= cold <= 1.0  # tmpfs keeps every page: 1.0 there, ~0 on a disk
    sf.prefetch(sf.keys())  # warm path (populate), then the cold path on the evicted copy: both only advice
    SafetensorsFile(f).prefetch(sf.keys())
    torch.testing.assert_close(logits(tmp_path), logits(tiny_official), rtol=0, atol=0)


def test_q_k_v_stay_views_of_one_c_attn_through_a_dtype_and_device_move(tiny_official: Path) -> None:
    """A load to another dtype or device converts each checkpoint tensor once and splits c_attn afterwards, so q, k
    and v stay views of one tensor and inference runs c_attn's one matmul, as transformers does (moved one by one,
    three matmuls ran: on CUDA not bit-exact). 'meta' stands in for an accelerator."""
    from gpt2_port.io import adapter
    from gpt2_port.io.load import read_checkpoint
    from gpt2_port.model.c_attn import c_attn_view, fused_qkv, qkv_tied

    for dtype, device in ((torch.bfloat16, "cpu"), (torch.float32, "meta")):
        sd, rep = read_checkpoint(tiny_official)
        state = adapter.convert_sources(
            rep.conversion, sd, rep.config, lambda t, d=device, dt=dtype: t.to(device=d, dtype=dt)
        )
        for i in range(rep.config.n_layer):
            q, k, v = (state[f"h.{i}.attn.{n}_proj.weight"] for n in "qkv")
            assert q.device.type == device and q.dtype == dtype
            assert q._base is not None and q._base is k._base is v._base  # one [C, 3C] tensor under all three
    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16, layout="checkpoint")
    for block in m.h:
        a = block.attn
        assert c_attn_view(
            a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.q_proj.bias, a.k_proj.bias, a.v_proj.bias
        )
        assert fused_qkv(a.q_proj, a.k_proj, a.v_proj) is not None
    # bf16 on the CPU by default: every weight contiguous [out, in] (the fast matmul layout there), q/k/v the row
    # blocks of one contiguous [3C, C] copy of c_attn, so that inference still runs one matmul
    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16)
    for i, block in enumerate(m.h):
        a = block.attn
        assert all(p.is_contiguous() for p in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.c_proj.weight))
        assert qkv_tied(a.q_proj, a.k_proj, a.v_proj) == "rows"
        w, b = fused_qkv(a.q_proj, a.k_proj, a.v_proj)
        assert w.is_contiguous() and w.shape == (3 * TINY.n_embd, TINY.n_embd)
        c_attn = sd[f"h.{i}.attn.c_attn.weight"].to(torch.bfloat16)
        assert torch.equal(w, c_attn.t()) and torch.equal(b, sd[f"h.{i}.attn.c_attn.bias"].to(torch.bfloat16))
        assert a.c_proj.weight.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()


def test_a_move_or_cast_after_the_load_keeps_q_k_v_views_of_one_c_attn(tiny_official: Path) -> None:
    """`model.to(...)` converts each parameter on its own; the attention makes q, k and v views of one c_attn again,
    so the moved model runs c_attn's one matmul and gives what a load straight into that dtype gives, bit for bit.
    'meta' stands in for an accelerator (a device move is the same per-parameter conversion)."""
    from gpt2_port.model.c_attn import fused_qkv, qkv_tied

    def tied(m: GPT2) -> bool:
        return all(qkv_tied(b.attn.q_proj, b.attn.k_proj, b.attn.v_proj) for b in m.h)

    ids = torch.tensor([[464, 2444, 4721, 11, 290, 262]]) % TINY.vocab_size
    m = GPT2.from_pretrained(str(tiny_official))
    assert tied(m)
    params = list(m.parameters())
    m.to(torch.bfloat16)
    assert tied(m) and all(fused_qkv(b.attn.q_proj, b.attn.k_proj, b.attn.v_proj) is not None for b in m.h)
    assert all(a is b for a, b in zip(params, m.parameters()))  # the same Parameter objects (optimizers hold them)
    direct = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16, layout="checkpoint")
    with torch.no_grad():
        torch.testing.assert_close(m(ids), direct(ids), rtol=0, atol=0)
    for to in (torch.float64, "meta"):
        m = GPT2.from_pretrained(str(tiny_official)).to(to)
        assert tied(m)
    # the contiguous layout's rows stay rows (each weight contiguous), and a model that was not tied (built from
    # scratch) is left as it was
    m = GPT2.from_pretrained(str(tiny_official), dtype=torch.bfloat16)
    kept = [weakref.ref(fused_qkv(b.attn.q_proj, b.attn.k_proj, b.attn.v_proj)[0]) for b in m.h]
    assert all(qkv_tied(b.attn.q_proj, b.attn.k_proj, b.attn.v_proj) == "rows" for b in m.to(torch.float32).h)
    gc.collect()
    assert all(r() is None for r in kept)  # the bf16 c_attn is not held by the view fused_qkv keeps
    assert all(b.attn.q_proj.weight.dtype == torch.float32 and b.attn.q_proj.weight.is_contiguous() for b in m.h)
    assert not tied(GPT2(TINY).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_contiguous_layout_saves_the_checkpoint_it_was_loaded_from(
    tiny_official: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    """q/k/v as row blocks of one [3C, C] (the contiguous layout), used and packed, write back c_attn's [C, 3C] as
    the file had it (in the load's dtype), every other tensor too."""
    from safetensors.torch import load_file

    m = GPT2.from_pretrained(str(tiny_official), dtype=dtype)
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))  # packs where this CPU can
    m.save_pretrained(tmp_path)
    saved, source = load_file(tmp_path / "model.safetensors"), load_file(tiny_official / "model.safetensors")
    assert set(saved) == {k for k in source if not k.endswith(".attn.bias")}
    for k, t in saved.items():
        assert torch.equal(t, source[k].to(dtype)), k
