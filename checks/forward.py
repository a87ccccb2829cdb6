"""The forward-parity runner: one configuration (dtype x device) or several, with sub-layer points, the noise floor
and the logit lens.

A single configuration is compared with transformers in the same dtype on the same device, under TOLERANCES.
Several configurations (`--dtype float32,bfloat16 --device cpu,cuda`) are each compared with ONE float32
transformers reference on the first device listed, under VS_FLOAT32_TOLERANCES.

The noise floor of a configuration is transformers' own spread around the same reference: every transformers run
that could stand in for it (its other attention kernel; in a sweep also its eager and sdpa runs in the
configuration's dtype and device), taking at each point the one furthest from the reference.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gpt2_port.devices import parse_device, parse_dtype
from gpt2_port.errors import UsageError
from gpt2_port.generate.forced import forced_logits
from gpt2_port.io.checkpoint import locate
from gpt2_port.io.load import nonfinite_tensors
from gpt2_port.io.tokenizer import Tokenizer, tokenizer_for
from gpt2_port.model import GPT2, from_pretrained

from .metrics import metrics, next_token
from .noise import verdict
from .points import (
    BATCH,
    DECODE,
    DECODE_FORWARD,
    capture_reference_points,
    capture_scratch_points,
    logit_lens_top1,
    point_names,
    real_positions,
    transformed,
)
from .prompts import Inputs, batch_rows, decode_batch, default_inputs, left_padded, resolve
from .reference import exact_matmuls, load_reference, reference_forced_logits, versions
from .results import PointResult, Report, Sweep
from .tolerances import TOLERANCES, VS_FLOAT32_TOLERANCES, Tolerance


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class Activations:
    """Point name -> the activations of every prompt, flattened on the CPU in their own dtype and concatenated."""

    def __init__(self) -> None:
        self._parts: dict[str, list[torch.Tensor]] = {}
        self.lens: torch.Tensor | None = None  # (n_layer, N) logit-lens top-1 ids, when asked for

    def blocks(self, n_layer: int, n_embd: int) -> torch.Tensor:
        """Every block's output stacked: (n_layer, N tokens, C)."""
        return torch.stack([self[f"block.{i}"].view(-1, n_embd) for i in range(n_layer)])

    def add(self, acts: dict[str, torch.Tensor]) -> None:
        for n, t in acts.items():
            self._parts.setdefault(n, []).append(t.detach().to("cpu").flatten())

    def __getitem__(self, name: str) -> torch.Tensor:
        return torch.cat(self._parts[name])


def _unique(xs: Sequence) -> list:
    return list(dict.fromkeys(xs))


def parse_list(value: str | Sequence[str]) -> list[str]:
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else list(value)
    if not items or any(not s for s in items):
        raise UsageError(f"empty item in list {value!r} (give comma-separated names)")
    return items


def _as_inputs(prompts: Sequence[str] | Inputs | None) -> Inputs:
    if prompts is None:
        return default_inputs()
    if isinstance(prompts, Inputs):
        return prompts
    inputs = Inputs([], [])
    for p in prompts:
        inputs.add_text(p)
    return inputs


def _has_tokenizer_files(d: Path) -> bool:
    return any(
        (d / v).is_file() and (d / m).is_file()
        for v, m in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"))
    )


def run_detailed(
    model: str,
    prompts: Sequence[str] | Inputs | None = None,
    dtypes: str | Sequence[str] = "float32",
    devices: str | Sequence[str] = "cpu",
    detail: str = "block",
    per_head: bool = False,
    noise_floor: bool = False,
    logit_lens: bool = False,
    reference_attn: str = "eager",
    attn: str = "auto",
    revision: str | None = None,
    tokenizer: str | None = None,
    transform: Callable[[GPT2], GPT2 | None] | None = None,
) -> Sweep:
    """Compare the scratch model with transformers on `prompts` (texts, Inputs, or None for the default prompts,
    which are stored as token ids and need no tokenizer). float32 matmuls stay float32 (no TF32) throughout.
    transform: a porter's change, applied to the loaded model of each configuration (points.transformed)."""
    with exact_matmuls():
        return _run_detailed(
            model,
            prompts,
            dtypes,
            devices,
            detail,
            per_head,
            noise_floor,
            logit_lens,
            reference_attn,
            attn,
            revision,
            tokenizer,
            transform,
        )


def _run_detailed(
    model: str,
    prompts: Sequence[str] | Inputs | None,
    dtypes: str | Sequence[str],
    devices: str | Sequence[str],
    detail: str,
    per_head: bool,
    noise_floor: bool,
    logit_lens: bool,
    reference_attn: str,
    attn: str,
    revision: str | None,
    tokenizer: str | None,
    transform: Callable[[GPT2], GPT2 | None] | None,
) -> Sweep:
    import transformers

    if detail not in ("block", "sublayer"):
        raise UsageError(f"--detail must be block or sublayer, got {detail!r}")
    dts = _unique(parse_dtype(d) for d in parse_list(dtypes))
    devs = _unique(parse_device(d) for d in parse_list(devices))  # every device checked before any work
    configs = [(dt, dev) for dev in devs for dt in dts]
    is_sweep = len(configs) > 1
    base = (torch.float32, devs[0]) if is_sweep else configs[0]
    if attn == "auto":  # like for like: the hand-written path does the eager reference's arithmetic, op for op
        attn = "manual" if reference_attn == "eager" else "sdpa"
    alt_attn = "sdpa" if reference_attn == "eager" else "eager"
    tv = transformers.__version__
    inputs = _as_inputs(prompts)

    t0 = time.perf_counter()
    # the checkpoint's layout (views of its [in, out] tensors): the same calls as transformers' Conv1D in every dtype
    scratch, rep = from_pretrained(
        model, dtype=configs[0][0], device=configs[0][1], revision=revision, layout="checkpoint"
    )
    t_scratch = time.perf_counter() - t0
    cfg, ckpt = rep.config, rep.checkpoint
    names = point_names(cfg.n_layer, detail, per_head, cfg.n_head)
    # The tokenizer is loaded only for text prompts, or for the logit lens's labels when one is at hand locally.
    tok: Tokenizer | None = None
    if inputs.needs_tokenizer or (logit_lens and (tokenizer is not None or _has_tokenizer_files(ckpt.root))):
        tok = tokenizer_for(ckpt.root, tokenizer)
    ids_list = resolve(inputs, lambda text: tok.encode(text), cfg.n_positions, cfg.vocab_size)
    n_tokens = sum(len(i) for i in ids_list)
    # every prompt alone, then one left-padded batch of them (and a long row), compared at its real tokens
    batch_ids, batch_mask = left_padded(batch_rows(ids_list, cfg.n_positions))

    # and generate's cached path: the prompts prefilled, then tokens fed one decode step at a time
    dec_ids, dec_mask, dec_prompt = decode_batch(ids_list, cfg.n_positions)

    def batch(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(batch_ids, device=dev), torch.tensor(batch_mask, device=dev)

    def decoding(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(dec_ids, device=dev), torch.tensor(dec_mask, device=dev)

    def run_ref(ref: torch.nn.Module, dev: torch.device, impl: str, decoding_impls: tuple[str, str]) -> Activations:
        """Every point from `ref` (running `impl`); its two cached decodings with `decoding_impls` (the plan's, the
        forward steps')."""
        acc = Activations()
        for ids in ids_list:
            acc.add(capture_reference_points(ref, torch.tensor([ids], device=dev), names, detail))
        ids, mask = batch(dev)
        acc.add(real_positions(capture_reference_points(ref, ids, names, detail, mask), mask))
        for point, decode_impl in zip((DECODE, DECODE_FORWARD), decoding_impls):
            ref.set_attn_implementation(decode_impl)
            acc.add({point: reference_forced_logits(ref, *decoding(dev), dec_prompt)})
        ref.set_attn_implementation(impl)
        if logit_lens:
            acc.lens = logit_lens_top1(
                acc.blocks(cfg.n_layer, cfg.n_embd), ref.transformer.ln_f, ref.get_output_embeddings().weight
            )
        return acc

    t0 = time.perf_counter()
    ref_base = load_reference(locate(model, revision), cfg, base[0], base[1], reference_attn)
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    # each cached decoding against transformers running the same kind of kernel (the plan attends with SDPA; the
    # forward steps with the scratch model's --attn), and its floor the other kind (below)
    like = ("sdpa", "eager" if attn == "manual" else "sdpa")
    want = run_ref(ref_base, base[1], reference_attn, like)
    t_base = time.perf_counter() - t0
    base_desc = f"transformers {tv} GPT2LMHeadModel ({reference_attn}), {dtype_name(base[0])}, {base[1]}"

    reports = []
    for k, (dt, dev) in enumerate(configs):
        t0 = time.perf_counter()
        if k > 0:
            scratch, _ = from_pretrained(model, dtype=dt, device=dev, revision=revision, layout="checkpoint")
        scratch = transformed(scratch, transform).eval()
        scratch.set_attn_impl(attn)  # type: ignore[arg-type]
        t_load = time.perf_counter() - t0 if k > 0 else t_scratch
        t0 = time.perf_counter()
        got = Activations()
        for ids in ids_list:
            got.add(capture_scratch_points(scratch, torch.tensor([ids], device=dev), names))
        ids, mask = batch(dev)
        got.add(real_positions(capture_scratch_points(scratch, ids, names, mask), mask))
        scratch.set_attn_impl("sdpa")  # generate's own path: the decode plan needs SDPA (the model's default)
        decoded, decode_path = forced_logits(scratch, *decoding(dev), dec_prompt)
        scratch.set_attn_impl(attn)  # type: ignore[arg-type]
        got.add({DECODE: decoded})
        # and its other cached path, the forward with the cache (the manual attention, records, hooks), in `attn`
        got.add({DECODE_FORWARD: forced_logits(scratch, *decoding(dev), dec_prompt, fast_step=False)[0]})
        if logit_lens:
            got.lens = logit_lens_top1(got.blocks(cfg.n_layer, cfg.n_embd), scratch.ln_f, scratch.head_weight)
        t_fwd = time.perf_counter() - t0 + (t_base if k == 0 else 0.0)

        t0 = time.perf_counter()
        floors: list[tuple[str, Activations]] = []
        if noise_floor:
            same = (dt, dev) == base
            ref_c = ref_base if same else copy.deepcopy(ref_base).to(device=dev, dtype=dt)
            for impl in (reference_attn, alt_attn):
                if same and impl == reference_attn:
                    continue  # that is the reference itself
                ref_c.set_attn_implementation(impl)
                # the decodings' floors: in this configuration transformers' other kernel than each decoding's
                # reference; in another one, each kernel in its dtype and device, as for every point
                other = tuple("eager" if k == "sdpa" else "sdpa" for k in like) if same else (impl, impl)
                floors.append((f"{impl} {dtype_name(dt)} {dev}", run_ref(ref_c, dev, impl, other)))
            ref_base.set_attn_implementation(reference_attn)
            del ref_c
        t_floor = time.perf_counter() - t0

        tol = (VS_FLOAT32_TOLERANCES if is_sweep else TOLERANCES)[dtype_name(dt)]
        all_names = [*names, *(BATCH + n for n in names), DECODE, DECODE_FORWARD]
        r = _report(model, all_names, got, want, floors, tol, scratch, tok, ids_list, logit_lens, cfg.n_layer)
        r.dtype, r.device, r.scratch_attn, r.detail = dtype_name(dt), str(dev), attn, detail
        r.reference = f"transformers {tv} GPT2LMHeadModel ({reference_attn})"
        r.reference_dtype, r.reference_device = dtype_name(base[0]), str(base[1])
        r.prompts, r.token_ids, r.n_tokens = list(inputs.texts), [list(i) for i in ids_list], n_tokens
        r.batch_ids, r.batch_mask = batch_ids, batch_mask
        r.decode_ids, r.decode_prompt_len, r.decode_path = dec_ids, dec_prompt, decode_path
        if noise_floor:
            r.noise_floor = (
                f"transformers {' / '.join(f for f, _ in floors)} against the reference "
                f"({reference_attn} {dtype_name(base[0])} {base[1]}); the furthest at each point"
                + (
                    "; the decode rows: its other kernel than the one they are held against"
                    if (dt, dev) == base
                    else ""
                )
            )
        r.timings = {
            "scratch_load_s": t_load,
            "reference_load_s": t_ref if k == 0 else 0.0,
            "forward_s": t_fwd,
            "noise_floor_s": t_floor,
        }
        r.versions = versions(devs)
        reports.append(r)
        del scratch, got, floors
        gc.collect()
    return Sweep(model=str(model), reports=reports, baseline=base_desc, is_sweep=is_sweep)


def run_parity(
    model: str,
    prompts: Sequence[str] | Inputs | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    reference_attn: str = "eager",
    attn: str = "auto",
    revision: str | None = None,
    tokenizer: str | None = None,
) -> Report:
    """The block-level comparison in one dtype on one device."""
    return run_detailed(
        model,
        prompts,
        dtypes=[dtype],
        devices=[device],
        reference_attn=reference_attn,
        attn=attn,
        revision=revision,
        tokenizer=tokenizer,
    ).reports[0]


def _report(
    model: str,
    names: Sequence[str],
    got: Activations,
    want: Activations,
    floors: Sequence[tuple[str, Activations]],
    tol: Tolerance,
    scratch: GPT2,
    tok: Tokenizer | None,
    ids_list: Sequence[Sequence[int]],
    logit_lens: bool,
    n_layer: int,
) -> Report:
    r = Report(model=str(model), dtype="", device="", reference="", scratch_attn="", prompts=[], n_tokens=0)
    for n in names:
        y = want[n]
        ma, nr, cos, el = metrics(got[n], y)
        t = tol.for_point(n)
        p = PointResult(n, ma, nr, cos, el, t, bool(nr <= t))
        if floors:
            fl = max((metrics(acc[n], y) for _, acc in floors), key=lambda m: m[1])
            v = verdict(nr, fl[1])
            p.noise_max_abs, p.noise_norm_rel = fl[0], fl[1]
            p.noise_ratio, p.within_noise, p.noise_verdict = v.ratio, v.within, v.text
        r.points.append(p)
    nt = next_token(got["logits"], want["logits"], scratch.config.vocab_size)  # over all prompts' positions
    r.top1_agreement, r.logprob_max_abs, r.nonfinite_logit_positions = (
        nt.top1_agreement,
        nt.logprob_max_abs,
        nt.n_nonfinite,
    )
    r.top1_tolerance, r.logprob_tolerance = tol.top1, tol.logprob_max_abs
    r.nonfinite_weights = nonfinite_tensors(scratch.state_dict())
    if logit_lens:
        last = len(ids_list[0]) - 1  # the last position of the first prompt
        for i in range(n_layer):
            a, b = got.lens[i], want.lens[i]
            sid, rid = int(a[last]), int(b[last])
            r.logit_lens.append(
                {
                    "layer": i,
                    "agreement": float((a == b).double().mean()),
                    "scratch_top1": tok.decode([sid]) if tok is not None else None,
                    "reference_top1": tok.decode([rid]) if tok is not None else None,
                    "scratch_id": sid,
                    "reference_id": rid,
                }
            )
    return r
