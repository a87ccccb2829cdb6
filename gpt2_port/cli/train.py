"""`gpt2-port train --init MODEL --data DIR --out DIR`: fine-tune a checkpoint or train from scratch;
`gpt2-port train --resume DIR` continues a saved run with its saved settings.

Runs as one process, or data-parallel under torchrun (`torchrun --nproc_per_node N -m gpt2_port train ...`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import signal
import sys
from pathlib import Path

from .common import (
    WEIGHT_FILES,
    add_progress_arg,
    check_holds_no_checkpoint,
    checkpoint_inputs,
    data_inputs,
    file_input,
    human_stream,
    report_written,
    tokenizer_inputs,
)

# torch's words when an op has no deterministic kernel and use_deterministic_algorithms(True) is on
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"

EPILOG = """\
batches: random windows x = data[i:i+T], y = data[i+1:i+1+T] from DIR/train.bin (uint16 token ids, as
`gpt2-port prepare` and nanoGPT write them). One seeded generator draws the whole global batch of a step:
--batch-size x --grad-accum x processes windows. The same --seed gives the same run.

counting: --steps is the total from the start of training: `--resume OUT --steps 20` continues a 10-step run to 20.

resume: `--resume OUT` alone continues the saved run with every setting it was started with (data directory, batch
and block size, accumulation, optimizer, learning rate and schedule, dtype, kernels, dropout, evaluation and save
cadence, seed, --steps). A flag given again overrides its saved value, and each override that makes the run differ
from an uninterrupted one is named on stderr with its old and new value. A moved data directory is an error that
names the saved path; --data DIR points to where it is now.

output (--out): the last saved step in the official layout (transformers and gpt2-port load OUT directly) with
trainer_state.json + trainer_state.safetensors for --resume; OUT/best: the step with the lowest val loss;
OUT/log.jsonl: one JSON object per step (step, train_loss, lr, grad_norm, tokens_per_s, mfu, elapsed_s, val_loss
on evaluated steps, skipped on skipped ones; null where a value is not finite); OUT/loss.png: the curves. A 124M
run directory holds about 1.9 GB (model 0.5, AdamW state 1.0, best/ 0.5).

Ctrl-C (or SIGTERM) is acknowledged at once: the run stops after the current step (an evaluation in progress is cut
short), saves a resumable state and exits with status 130; a second Ctrl-C stops at once without saving.

data-parallel: torchrun --nproc_per_node N -m gpt2_port train ... (gloo on CPU, nccl on CUDA); multi-node:
torchrun --nnodes M --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:29500 --nproc_per_node N -m gpt2_port train
"""


OOM_HINT = (
    "a smaller --batch-size (--grad-accum keeps the tokens a step), --grad-checkpointing or a shorter --block-size"
)


def register(sub: argparse._SubParsersAction) -> None:
    from ..train.args import DTYPE_CHOICES, KERNEL_CHOICES, TrainArgs, train_dtype

    d = TrainArgs()
    p = sub.add_parser(
        "train",
        help="fine-tune GPT-2 or train it from scratch on .bin token files (resumable, DDP via torchrun)",
        description="Train MODEL on DIR/train.bin with AdamW, evaluate on DIR/val.bin, save in the official layout; "
        "or continue a saved run with --resume OUT.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bool_flag = argparse.BooleanOptionalAction
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--init",
        metavar="MODEL",
        help="checkpoint dir, .safetensors or Hub id; with --from-scratch: "
        "a size preset (gpt2, gpt2-medium, ...) or a config.json",
    )
    g.add_argument("--from-scratch", action="store_true", help="build a new model from --init's config (GPT-2 init)")
    g.add_argument(
        "--data", metavar="DIR", help="directory with train.bin (and val.bin); a resume reuses the saved one"
    )
    g.add_argument("--out", metavar="DIR", help="output directory (default: the --resume directory)")
    g.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR with its saved settings")
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="vocab.json + merges.txt to save beside the model and for samples (default: the checkpoint's)",
    )
    g = p.add_argument_group("length and batch")
    g.add_argument("--steps", type=int, help=f"total optimizer steps from the start ({d.steps})")
    g.add_argument("--batch-size", type=int, help=f"micro-batch per process ({d.batch_size})")
    g.add_argument("--block-size", type=int, help="window length, at most n_positions (n_positions)")
    g.add_argument("--grad-accum", type=int, help=f"micro-steps per step ({d.grad_accum})")
    g.add_argument(
        "--stop-at",
        type=int,
        metavar="N",
        help="stop after step N with a resumable state; the schedule still spans --steps",
    )
    g = p.add_argument_group("schedule and optimizer")
    g.add_argument("--lr", type=float, help=f"peak learning rate ({d.lr})")
    g.add_argument("--min-lr", type=float, help="learning rate at the last step (lr / 10)")
    g.add_argument("--warmup", type=int, help=f"linear warmup steps ({d.warmup})")
    g.add_argument("--schedule", choices=("cosine", "constant"), help=f"after warmup ({d.schedule})")
    g.add_argument("--beta1", type=float, help=f"AdamW beta1 ({d.beta1})")
    g.add_argument("--beta2", type=float, help=f"AdamW beta2 ({d.beta2})")
    g.add_argument("--eps", type=float, help=f"AdamW eps ({d.eps})")
    g.add_argument("--weight-decay", type=float, help=f"on weights of 2+ dims only ({d.weight_decay})")
    g.add_argument("--clip", type=float, help=f"gradient norm clip, 0 for none ({d.clip})")
    g = p.add_argument_group("model options")
    g.add_argument("--dropout", type=float, help="every dropout rate (default: the checkpoint's)")
    g.add_argument("--grad-checkpointing", action=bool_flag, help="recompute blocks in backward: less memory (off)")
    g.add_argument(
        "--kernels",
        choices=KERNEL_CHOICES,
        help="reference: transformers' arithmetic op for op (bit-identical gradients); fast: one-kernel GELU and "
        "the head fused with the loss (less time and memory, gradients within transformers' own noise); auto "
        "(default): reference in float32, fast under bf16/fp16 (docs/training.md)",
    )
    g.add_argument(
        "--pad-vocab",
        type=int,
        metavar="N",
        help="the fast kernels' fused head computes over the vocabulary padded to a multiple of N (50257 -> 50304 "
        "for 64; the pad's logits are -inf, saved files keep 50257 rows); 1: none (default: 64 on CUDA, 1 elsewhere)",
    )
    g.add_argument(
        "--compile",
        action=bool_flag,
        help="torch.compile the training and evaluation forward (one graph; under torchrun, split at DDP's gradient "
        "buckets; off)",
    )
    g = p.add_argument_group("evaluation and saving")
    g.add_argument("--eval-every", type=int, help=f"steps between val losses ({d.eval_every})")
    g.add_argument("--eval-batches", type=int, help=f"batches per val loss ({d.eval_batches})")
    g.add_argument("--save-every", type=int, help="steps between checkpoints (0: at the end)")
    g.add_argument("--sample-every", type=int, help="steps between samples in the log (0)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, help=f"seed of the batches, dropout and init ({d.seed})")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument(
        "--dtype",
        type=train_dtype,
        choices=DTYPE_CHOICES,
        help="float32 (default); bf16 (autocast; or bfloat16); fp16 (autocast + grad scaler, CUDA; or float16)",
    )
    g.add_argument("--tf32", action=bool_flag, help="CUDA: float32 matmuls on TF32 tensor cores (on; --no-tf32: off)")
    g.add_argument(
        "--deterministic",
        action=bool_flag,
        help="deterministic kernels (torch.use_deterministic_algorithms): on CUDA the attention backward without "
        "atomics, so a run and its resume give the same bits; slower (off; on the CPU the default kernels already are)",
    )
    g.add_argument(
        "--overlap",
        action=bool_flag,
        help="queue the next step before reading this one's loss, so the device does not wait for the host between "
        "steps; the same weights, a Ctrl-C taken a step later (default: on CUDA; --no-overlap: read each step "
        "first)",
    )
    g.add_argument(
        "--skip-nonfinite", action=bool_flag, help="skip a step whose loss or gradients are NaN/Inf (default: stop)"
    )
    g.add_argument("--json", metavar="PATH", help="write the run's summary as JSON")
    add_progress_arg(g, "steps, loss and tokens/s")
    g.add_argument("--no-plot", action="store_true", help="do not write OUT/loss.png (which needs matplotlib)")
    g.add_argument("--no-memory-check", action="store_true", help="start even if the memory check says it won't fit")
    p.set_defaults(func=run, oom_hint=OOM_HINT)


def plot_loss(records: list[dict], path: Path) -> None:
    """Train loss per step and val loss where evaluated."""
    from ..plots import pyplot, save_png

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    pts = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    if pts:
        ax.plot(*zip(*pts), label="train loss", lw=1)
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)


# What a run writes into --out (into OUT/best/ as well), besides the tokenizer files copied beside the model (a copy
# onto itself is skipped, so --tokenizer may name --out)
MODEL_FILES = ("model.safetensors", "config.json")
TOKENIZER_FILES = ("vocab.json", "merges.txt")


def run_files() -> tuple[str, ...]:
    from ..train.run_dir import LOG_FILE
    from ..train.state import STATE_JSON, STATE_TENSORS

    return (*MODEL_FILES, STATE_JSON, STATE_TENSORS, LOG_FILE, "loss.png")


def read_inputs(args: argparse.Namespace, data: str, resuming: bool) -> list:
    """The files a new run or a resume reads and must not write over (files.Inputs): the --init checkpoint (or
    config), the prepared data, the tokenizer. A resume's own files in --out are rewritten on purpose."""
    init: list = []
    if args.init is not None and not resuming:
        p = Path(args.init)
        if not args.from_scratch:
            init = checkpoint_inputs(args.init, "--init")
        elif p.is_file():
            init = file_input(args.init, "--init")
        elif p.is_dir():
            init = file_input(str(p / "config.json"), "--init")
    return init + data_inputs(data) + tokenizer_inputs(args.tokenizer)


def check_out_is_free(out: Path, resume: str | None) -> None:
    """Refuse an --out that holds a run or a checkpoint a new run would replace (the --resume directory itself is
    continued, not replaced)."""
    from ..errors import UsageError
    from ..files import same_file
    from ..train.state import STATE_JSON

    if resume is not None and same_file(out, resume):
        return
    if (out / STATE_JSON).exists():
        raise UsageError(
            f"--out {out}: holds a training run already; continue it with --resume {out}, or choose another --out"
        )
    check_holds_no_checkpoint(out, WEIGHT_FILES, "the run")


def json_inputs(args: argparse.Namespace, out: Path, read: list) -> list:
    """What --json must not be written over: the run's inputs, the --resume directory's files and the files the run
    writes into --out (files.Inputs)."""
    from ..train.state import STATE_JSON, STATE_TENSORS

    names = [*run_files(), *TOKENIZER_FILES]
    kept = [(f"a file the run writes in --out {out}", out / name) for name in names]
    kept += [(f"a file the run writes in --out {out}", out / "best" / name) for name in MODEL_FILES + TOKENIZER_FILES]
    resumed = []
    if args.resume is not None:
        resumed = checkpoint_inputs(args.resume, "--resume")
        resumed += [
            (f"a file of --resume {args.resume} (an input)", Path(args.resume) / n) for n in (STATE_JSON, STATE_TENSORS)
        ]
    return read + resumed + kept


def _summary_line(result, targs, out: Path) -> str:  # noqa: ANN001
    val = "" if result.val_loss is None else f", val loss {result.val_loss:.4f}"
    best = "" if result.best_step is None else f" (best {result.best_val_loss:.4f} at step {result.best_step})"
    tl = "n/a" if result.train_loss is None else f"{result.train_loss:.4f}"
    took = f"in {result.elapsed_s:.1f}s"
    if result.start_step:
        took += f" ({result.total_elapsed_s:.1f}s since step 0)"
    rate = f"{result.tokens_per_s:,.0f} tok/s mean, {result.last_tokens_per_s:,.0f} the last step"
    if result.mfu is not None:
        rate += f", MFU {100 * result.mfu:.1f}%"
    where = f"model in {out}" + (f", best in {out / 'best'}" if result.best_step else "")
    return f"trained steps {result.start_step}->{result.step} {took}: train loss {tl}{val}{best}; {rate}; {where}"


def run(args: argparse.Namespace) -> int:
    import torch

    from ..devices import parse_device, peak_rss_mb
    from ..errors import UsageError
    from ..files import check_dir_writable, check_writable, write_output
    from ..io.tokenizer import load_tokenizer
    from ..model import GPT2
    from ..plots import require_matplotlib
    from ..train import Callbacks, Trainer, distributed, prepare_model
    from ..train import state as trainer_state
    from ..train.data import open_split
    from ..train.memory import check_memory
    from ..train.run_dir import LOG_FILE, read_log
    from ..train.setup import deterministic_kernels, same_model
    from .progress import Progress
    from .train_settings import init_config, load_checkpoint, run_settings, scratch_config

    if args.resume is None and args.init is None:
        raise UsageError("--init MODEL is required (or --resume DIR to continue a run)")
    if args.from_scratch and args.init is None:
        raise UsageError("--from-scratch needs --init: a size preset (gpt2, ...) or a config.json")
    if args.out is None and args.resume is None:
        raise UsageError("--out DIR is required (it receives the model, the trainer state and log.jsonl)")
    out = Path(args.out if args.out is not None else args.resume)
    dist = distributed.from_env()
    device = distributed.device_for(dist, parse_device(args.device))
    if not dist.is_main and not args.verbose:
        logging.getLogger("gpt2_port").setLevel(logging.ERROR)  # rank 0 logs the warnings every process would

    def warn(msg: str) -> None:
        if dist.is_main:
            sys.stderr.write(f"WARNING resume: {msg}\n")

    state = trainer_state.load(args.resume) if args.resume is not None else None
    if state is not None and args.init is not None:
        cfg = scratch_config(args.init) if args.from_scratch else init_config(args.init)
        if cfg is not None:
            same_model(cfg, state.model_config, f"--resume {args.resume}")
    targs = run_settings(args, state, dist, warn)
    if state is not None and targs.stop_at is not None and targs.stop_at <= state.step:
        raise UsageError(
            f"--stop-at {targs.stop_at}: the run in {args.resume} is at step {state.step} already (expected a later "
            "step)"
        )
    read = read_inputs(args, targs.data, resuming=state is not None)
    if dist.is_main:
        check_dir_writable(out, "--out", read, run_files())
        if args.json:
            check_writable(args.json, "--json", json_inputs(args, out, read))
        if not args.no_plot:
            require_matplotlib("OUT/loss.png", "--no-plot")
    check_out_is_free(out, args.resume)
    # the tokenizer named is read now, not at the first save, where a missing file would cost the whole run
    tokenizer = load_tokenizer(args.tokenizer, strict=True) if args.tokenizer is not None else None
    if state is not None:
        model = load_checkpoint(args.resume)
    elif args.from_scratch:
        model = GPT2(scratch_config(args.init)).init_weights(targs.seed)
    else:
        model = load_checkpoint(args.init)
    cfg = model.config
    block = targs.block_size or cfg.n_positions
    if block > cfg.n_positions:
        raise UsageError(f"--block-size {block} is larger than the model's context n_positions={cfg.n_positions}")
    train_data = open_split(targs.data, "train", cfg.vocab_size, block)
    val_data = None
    if (Path(targs.data) / "val.bin").is_file():
        val_data = open_split(targs.data, "val", cfg.vocab_size, block, optional=True)
    elif dist.is_main:
        sys.stderr.write(f"note: {targs.data} has no val.bin: no validation loss, no OUT/best\n")
    mem = None
    if not args.no_memory_check and device.type != "cuda":
        mem = check_memory(cfg, targs, block, device, dist)
    if tokenizer is None and targs.sample_every:
        init_dir = args.init if args.init is not None and Path(args.init).is_dir() else None
        tokenizer = load_tokenizer(args.resume or init_dir)
    distributed.init(dist, device)
    bar: Progress | None = None
    started: dict = {}  # the run's description (Trainer.describe), for the summary
    trainer: Trainer | None = None
    settings = contextlib.ExitStack()
    try:
        settings.enter_context(deterministic_kernels(device, targs.deterministic))
        prepare_model(model, targs, device)
        show = dist.is_main and args.progress

        def on_start(info: dict) -> None:
            nonlocal bar
            started.update(info)
            sys.stderr.write(
                f"run: {info['params'] / 1e6:.1f}M parameters on {device}, {info['dtype']}, kernels "
                f"{info['kernels']}{info['head']}, attention {info['attention']}, "
                f"compile {'on' if info['compile'] else 'off'}, overlap {'on' if info['overlap'] else 'off'}; "
                f"global batch {info['global_batch']} x {info['block_size']} tokens on {info['world_size']} "
                f"process(es); MFU against {info['peak']}\n"
            )
            if show:
                bar = Progress("train", targs.steps, "steps", start=info["start_step"])

        def on_step(r: dict) -> None:
            if bar is not None:
                loss = "nan" if r["train_loss"] is None else f"{r['train_loss']:.4f}"
                vl = r.get("val_loss")
                val = "" if "val_loss" not in r else " val nan" if vl is None else f" val {vl:.4f}"
                m = f" MFU {100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
                bar.update(r["step"], f"loss {loss}{val} lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s{m}")
            if "sample" in r:
                sys.stderr.write(f"\nsample at step {r['step']}: {r['sample']!r}\n")

        def on_eval(done: int, total: int) -> None:
            if bar is not None and bar.tty:
                bar.update(bar.done, f"{bar.note.split(' | ')[0]} | evaluating {done}/{total}")

        trainer = Trainer(
            model,
            targs,
            train_data,
            val_data,
            out,
            device=device,
            dist=dist,
            resume=state,
            resume_dir=args.resume,
            tokenizer=tokenizer,
            tokenizer_dir=args.tokenizer,
            callbacks=Callbacks(on_step=on_step, on_start=on_start, on_eval=on_eval),
        )
        if not args.no_memory_check and device.type == "cuda":
            mem = trainer.check_cuda_memory()
        if dist.is_main and mem is not None:
            sys.stderr.write(
                f"memory: {mem['method']} {mem['detail']} of {mem['available_bytes'] / 2**30:.1f} GiB available "
                f"({mem['source']})\n"
            )

        def on_signal(signum: int, frame: object) -> None:
            # a second Ctrl-C stops now; a second SIGTERM does not (a scheduler may signal every process of the job
            # and torchrun pass its own on too, so one request can arrive twice)
            if trainer is not None and trainer._stop:
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                return
            trainer.request_stop()  # type: ignore[union-attr]
            if dist.is_main:
                if bar is not None:
                    bar.abandon()
                when = "the steps already queued" if trainer.overlap else "this step"  # type: ignore[union-attr]
                term = signum == signal.SIGTERM
                sys.stderr.write(
                    f"{'SIGTERM: ' if term else ''}stopping after {when} (a resumable state is saved); "
                    f"Ctrl-C {'' if term else 'again '}to stop now without saving\n"
                )
                sys.stderr.flush()

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            result = trainer.run()
        except KeyboardInterrupt:
            if bar is not None:
                bar.abandon()
            if dist.is_main:
                saved = trainer.last_saved
                where = f"the last saved state in {out} is step {saved}" if saved else f"nothing was saved in {out}"
                sys.stderr.write(f"stopped at once (second Ctrl-C) without saving: {where}\n")
            return 130
        except BaseException:
            if bar is not None:
                bar.abandon()
            raise
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if bar is not None:
            bar.close()
    except RuntimeError as e:
        if targs.deterministic and NO_DETERMINISTIC_KERNEL in str(e):
            op = str(e).split(NO_DETERMINISTIC_KERNEL)[0].strip()
            raise UsageError(
                f"--deterministic: {op} has no deterministic kernel on {device}; run without --deterministic"
            ) from None
        raise
    finally:
        settings.close()
        distributed.shutdown(dist)
    if not dist.is_main:
        return 130 if result.interrupted else 0
    if not args.no_plot:
        plot_loss(read_log(out / LOG_FILE, result.step), out / "loss.png")
    summary = {
        "out": str(out),
        "start_step": result.start_step,
        "step": result.step,
        "steps": targs.steps,
        "interrupted": result.interrupted,
        "stopped_at": result.stopped_at,
        "train_loss": result.train_loss,
        "val_loss": result.val_loss,
        "best_val_loss": result.best_val_loss,
        "best_step": result.best_step,
        "elapsed_s": result.elapsed_s,
        "total_elapsed_s": result.total_elapsed_s,
        "tokens_per_s": result.tokens_per_s,
        "last_tokens_per_s": result.last_tokens_per_s,
        "mfu": result.mfu,
        "global_batch": trainer.global_batch,
        "block_size": block,
        "world_size": dist.world_size,
        "kernels": targs.resolved_kernels,
        "head_vocab": model.loss_vocab,
        "dtype": targs.dtype,
        "compile": targs.compile,
        "attention": started.get("attention"),  # the kernel SDPA ran for this batch, as the first lines name it
        "device": str(device),
        "skipped_steps": result.skipped_steps,
        "peak_rss_mb": peak_rss_mb(),
        "peak_device_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "memory_estimate_mb": mem["estimate_bytes"] / 2**20 if mem is not None else None,
        "memory_method": mem["method"] if mem is not None else None,
    }
    say = functools.partial(print, file=human_stream(args.json))  # `--json -`: stdout holds the JSON alone
    if args.json:
        report_written([write_output(args.json, json.dumps(summary, indent=2) + "\n", "--json")])
    if result.stopped_at:
        say(f"stopped at step {result.step}/{targs.steps} (--stop-at): state saved in {out}; continue with")
        say(f"gpt2-port train --resume {out}")
        return 0
    if result.interrupted:
        if result.step >= targs.steps:
            skipped = " (its final evaluation skipped)" if result.eval_skipped else ""
            done = f"interrupted at step {result.step}/{targs.steps}, the last: the run is complete{skipped}"
            say(f"{done}; saved in {out}")
        else:
            say(f"interrupted at step {result.step}/{targs.steps}: state saved in {out}; continue with")
            say(f"gpt2-port train --resume {out}")
        return 130
    say(_summary_line(result, targs, out))
    return 0
