"""Markdown for the benchmark results, and the in-place refresh of its section in BENCHMARKS.md."""

from __future__ import annotations

import os

from gpt2_port.files import STDOUT, target_of, write_output

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _r(x: float) -> str:
    return f"{x:.2f}x"


def _misses(par: dict) -> str:
    m = par.get("disagreement_ref_margins") or []
    if not m:
        return ""
    return (
        f" (reference top-1 - top-2 logit gap at the misses: {', '.join(f'{x:.3f}' for x in m[:4])}; "
        f"median gap {par['ref_median_margin']:.3f})"
    )


def render(res: dict) -> str:
    m, bw = res["machine"], res["membw"]
    out = [
        "## Speed and memory: gpt2_port vs transformers",
        "",
        f"- Command: `{res['command']}` (started {res['started']}, {res['total_s'] / 60:.1f} min)",
        f"- Machine: {m.get('cpu', '?')}, {m.get('cpu_count')} CPUs ({m.get('cpu_capability')}), "
        f"{m.get('mem_total_GB', 0):.1f} GB RAM{', GPU ' + m['gpu'] if m.get('gpu') else ''}; "
        f"load average {', '.join(f'{x:.1f}' for x in m.get('loadavg_start', []))} at start, "
        f"{', '.join(f'{x:.1f}' for x in m.get('loadavg_end', []))} at end",
        f"- Versions: torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; "
        f"device {res['settings']['device']}, threads {bw['threads']}",
        f"- Measured memory bandwidth ({bw.get('device', 'cpu')}): read {bw['read_GBps']:.1f} GB/s (sum of a "
        f"{bw['bytes'] / 2**20:.0f} MiB float32 tensor), copy {bw['copy_GBps']:.1f} GB/s (read + write)",
        "- Ratios are gpt2_port / transformers: below 1 is better for times and memory, above 1 for tok/s. "
        "Prefill and decode: both models in one process, runs interleaved (ours, hf; hf, ours; ...), best run "
        "of each (every run in `runs` in the JSON).",
        "",
        "### Load (one fresh process per load, ours and transformers alternating; the median of the rounds)",
        "",
        "Time to a ready model = from the load call (libraries already imported) to the end of a first one-token "
        "forward. Peak RSS = the process's VmHWM at that point, libraries included; 'load delta' subtracts the RSS "
        "before the load call. Checkpoint bytes include the official file's attn.bias mask buffers, which neither "
        "implementation keeps. Import s = process start to libraries imported (torch; + transformers for hf), "
        "not part of the load time.",
        "",
        "| size | params MB | file MB | cache | load s (ours / hf) | ratio | all rounds (ours; hf) "
        "| import s (ours / hf) | peak RSS MB (ours / hf) | ratio "
        "| ours peak / params | ours load delta / params | hf peak / params |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size, r in res["sizes"].items():
        s = r["summary"]
        pb = r["runs"]["ours_float32"]["param_bytes"]
        for cache in ("cold", "warm"):
            if f"load_s_{cache}" not in s:
                continue
            lo, lh, lr = s[f"load_s_{cache}"]
            mo, mh, mr = s[f"peak_rss_MB_{cache}"]
            lo_, lh_ = r["loads"][f"ours_{cache}"], r["loads"][f"hf_{cache}"]
            rounds = "; ".join(" ".join(f"{t:.2f}" for t in x.get("load_runs", [x["load_s"]])) for x in (lo_, lh_))
            out.append(
                f"| {size} | {pb / 1e6:.0f} | {r['file_bytes'] / 1e6:.0f} | {cache} | {lo:.2f} / {lh:.2f} "
                f"| {_r(lr)} | {rounds} | {lo_['import_s']:.1f} / {lh_['import_s']:.1f} "
                f"| {mo:.0f} / {mh:.0f} | {_r(mr)} | {s[f'rss_over_params_{cache}']:.2f} "
                f"| {s[f'load_delta_over_params_{cache}']:.2f} | {s[f'hf_rss_over_params_{cache}']:.2f} |"
            )
    methods = {r.get("cache_method") for r in res["sizes"].values() if r.get("cache_method")}
    if methods:
        out += [
            "",
            f"Cold page cache: evicted before each cold load with {', '.join(sorted(methods))}; warm: the "
            "file was read once before the load.",
        ]
    out += [
        "",
        "### Prefill and decode (float32, batch 1 decode, greedy)",
        "",
        "Prefill = one forward over B x T random tokens that fills a KV cache and returns the last position's logits "
        "(transformers: `use_cache=True, logits_to_keep=1`). Decode = "
        f"{res['settings']['prompt_len']}-token prompt, {res['settings']['new_tokens']} new tokens, greedy, "
        "tok/s = new tokens / wall time of the whole call (ours: `model.generate(do_sample=False)`: on the CPU "
        "DecodePlan steps over the KV cache and the proven-exact fast greedy head, on CUDA the fixed-shape step "
        "replayed as a CUDA graph; transformers: `generate(do_sample=False)`). Cap = the measured read bandwidth "
        "of the memory the weights are in (the GPU's on CUDA) / bytes of the float32 weights (the screened greedy "
        "head, where oneDNN has bf16 kernels, reads the head in bf16: 421 of 498 MB a token at 124M). Same tokens = "
        "greedy tokens equal to transformers' before the first difference.",
        "",
    ]
    shapes = list(next(iter(res["sizes"].values()))["runs"]["ours_float32"].get("prefill", {}))
    head = "| size | " + " | ".join(f"prefill {sh} ms (ours / hf) | ratio" for sh in shapes)
    head += (
        " | decode tok/s (ours / hf) | ratio | weight GB/s (ours / hf) | cap tok/s | share of cap (ours / hf) "
        "| same tokens |"
    )
    out += [head, "|" + "---|" * (head.count("|") - 1)]
    for size, r in res["sizes"].items():
        s = r["summary"]
        cells = [size]
        for sh in shapes:
            po, ph, pr = s[f"prefill_{sh}_s"]
            cells += [f"{po * 1e3:.0f} / {ph * 1e3:.0f}", _r(pr)]
        do, dh, dr = s["decode_tok_s"]
        wo = r["runs"]["ours_float32"]["decode"]["weight_GBps"]
        wh = r["runs"]["hf_float32"]["decode"]["weight_GBps"]
        n = r["runs"]["ours_float32"]["decode"]["new_tokens"]
        cells += [
            f"{do:.1f} / {dh:.1f}",
            _r(dr),
            f"{wo:.1f} / {wh:.1f}",
            f"{s['decode_cap_tok_s']:.1f}",
            f"{100 * s['decode_share_of_cap']:.0f}% / {100 * s['hf_decode_share_of_cap']:.0f}%",
            f"{s['decode_tokens_match']}/{n}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    variants = [
        (size, name, v)
        for size, sr in res["sizes"].items()
        for run in (sr["runs"]["ours_float32"], sr["runs"]["hf_float32"])
        for name, v in run.get("decode_variants", {}).items()
    ]
    if variants:
        out += [
            "",
            "### Decode variants (float32, batch 1, in the same process and rounds as the table above)",
            "",
            "ours_nograph = the same fixed-shape step run eagerly (`generate --no-cuda-graph`); hf_static = "
            'transformers\' generate with `cache_implementation="static"`.',
            "",
            "| size | variant | decode tok/s | vs hf (dynamic cache) | same tokens |",
            "|---|---|---|---|---|",
        ]
        for size, name, v in variants:
            s = res["sizes"][size]["summary"]
            out.append(
                f"| {size} | {name} | {v['tok_s']:.1f} | {_r(s[f'{name}_tok_s'][2])} "
                f"| {s[f'{name}_tokens_match']}/{v['new_tokens']} |"
            )
    lowp = [
        (size, k, r)
        for size, sr in res["sizes"].items()
        for k, r in sr["runs"].items()
        if k.startswith("ours_") and k != "ours_float32" and "decode" in r
    ]
    if lowp:
        out += [
            "",
            "### Low precision (gpt2_port decode, batch 1)",
            "",
            "int8 = `gpt2_port.generate.int8.quantize_int8(model)`: per-output-row int8 weights for every block Linear "
            "and the head, fbgemm dynamic int8 matmul plus a second pass over the activations' quantization "
            "residual (the accuracy of weight-only int8); int8-fast = `quantize_int8(model, "
            "exact_activations=False)`: one pass, 7-bit activations. Parity is against transformers in "
            "float32 (eager) on the parity prompts: norm-relative error of the worst block output and of the "
            "logits, top-1 next-token agreement, largest log-prob difference. bfloat16 and float16 run beside "
            "transformers in the same dtype (vs same dtype: decode speed against it); greedy tokens = the tokens "
            "equal to transformers' (same dtype where it ran, else float32) before the first difference.",
            "",
            "| size | option | decode tok/s | vs hf float32 | vs same dtype | weight GB/s | worst block norm_rel "
            "| logits norm_rel | top-1 agreement | max abs log-prob diff | greedy tokens = hf |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for size, k, r in lowp:
            s = res["sizes"][size]["summary"]
            opt = k.removeprefix("ours_")
            par = res["sizes"][size].get("parity", {}).get("options", {}).get(opt)
            n = r["decode"]["new_tokens"]
            pc = (
                f"{par['worst_block_norm_rel']:.2e} | {par['logits_norm_rel']:.2e} | "
                f"{100 * par['top1_agreement']:.1f}% of {par['n_positions']}{_misses(par)} | "
                f"{par['logprob_max_abs']:.3f}"
                if par
                else "- | - | - | -"
            )
            same = s.get(f"{k}_vs_same_dtype")
            out.append(
                f"| {size} | {opt} | {r['decode']['tok_s']:.1f} | {_r(s[f'{k}_tok_s'][2])} "
                f"| {_r(same) if same is not None else '-'} | {s[f'{k}_weight_GBps']:.1f} | {pc} "
                f"| {s[f'{k}_tokens_match_hf']}/{n} ({s.get(f'{k}_tokens_against', 'float32')}) |"
            )
    prefills = [(size, k, r) for size, k, r in lowp if r.get("prefill")]
    if prefills:
        shapes = list(prefills[0][2]["prefill"])
        out += [
            "",
            "### Low-precision prefill (beside transformers in the same dtype, in one process, runs interleaved)",
            "",
            "ms = the best run of each; vs our float32 = this prefill's time over ours in float32 (the table above).",
            "",
            "| size | option | "
            + " | ".join(f"prefill {sh} ms (ours / hf) | ratio | vs our float32" for sh in shapes)
            + " |",
            "|---|---|" + "---|---|---|" * len(shapes),
        ]
        for size, k, _ in prefills:
            s = res["sizes"][size]["summary"]
            cells = [size, k.removeprefix("ours_")]
            for sh in shapes:
                po, ph, pr = s[f"{k}_prefill_{sh}_s"]
                cells += [f"{po * 1e3:.0f} / {ph * 1e3:.0f}", _r(pr), _r(s[f"{k}_prefill_{sh}_vs_float32"])]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def update_markdown(path: str | os.PathLike[str], section: str) -> str:
    """Replace the text between the bench markers in `path` (append the section when the markers are absent); `-`
    writes the marked section alone to stdout. Returns what write_output reports (the path; STDOUT for `-`)."""
    block = f"{BEGIN}\n{section.rstrip()}\n{END}\n"
    if os.fspath(path) == STDOUT:
        return write_output(path, block, "--markdown")
    p = target_of(path)  # through a symlink: the target's text is the one updated
    text = p.read_text(encoding="utf-8") if p.is_file() else "# Benchmarks\n\n"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        i, j = text.index(BEGIN), text.index(END) + len(END)
        text = text[:i] + block.rstrip("\n") + text[j:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    return write_output(path, text, "--markdown")
