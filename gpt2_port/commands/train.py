"""`gpt2-port train --init MODEL --data DIR --out DIR`: fine-tune a checkpoint or train from scratch; resume exactly.

Runs as one process, or data-parallel under torchrun (`torchrun --nproc_per_node N -m gpt2_port train ...`).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

EPILOG = """\
batches: random windows x = data[i:i+T], y = data[i+1:i+1+T] from DIR/train.bin (uint16 token ids, as
`gpt2-port prepare` and nanoGPT write them). One seeded generator draws the whole global batch of a step:
--batch-size x --grad-accum x processes windows. The same --seed gives the same run.

counting: --steps is the total from the start of training: `--resume OUT --steps 20` continues a 10-step run to 20.

output (--out): the last saved step in the official layout (transformers and gpt2-port load OUT directly) with
trainer_state.json + trainer_state.safetensors for --resume; OUT/best: the step with the lowest val loss;
OUT/log.jsonl: one JSON object per step (step, train_loss, lr, grad_norm, tokens_per_s, elapsed_s, and val_loss on
evaluated steps); OUT/loss.png: the curves.

Ctrl-C (or SIGTERM) saves a resumable state after the current step, then exits with status 130.

data-parallel: torchrun --nproc_per_node N -m gpt2_port train ... (gloo on CPU, nccl on CUDA); multi-node:
torchrun --nnodes M --node_rank R --rdzv_backend c10d --rdzv_endpoint HOST:29500 --nproc_per_node N -m gpt2_port train
"""


def register(sub: argparse._SubParsersAction) -> None:
    from ..train import DTYPE_CHOICES, TrainArgs

    d = TrainArgs()
    p = sub.add_parser(
        "train",
        help="fine-tune GPT-2 or train it from scratch on .bin token files (resumable, DDP via torchrun)",
        description="Train MODEL on DIR/train.bin with AdamW, evaluate on DIR/val.bin, save in the official layout.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("model and data")
    g.add_argument(
        "--init",
        metavar="MODEL",
        help="checkpoint dir, .safetensors or Hub id; with --from-scratch: "
        "a size preset (gpt2, gpt2-medium, ...) or a config.json",
    )
    g.add_argument("--from-scratch", action="store_true", help="build a new model from --init's config (GPT-2 init)")
    g.add_argument("--data", metavar="DIR", required=True, help="directory with train.bin (and val.bin)")
    g.add_argument("--out", metavar="DIR", help="output directory (default: the --resume directory)")
    g.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR exactly")
    g.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="vocab.json + merges.txt to save beside the model and for samples (default: the checkpoint's)",
    )
    g = p.add_argument_group("length and batch")
    g.add_argument("--steps", type=int, default=d.steps, help=f"total optimizer steps from the start ({d.steps})")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help=f"micro-batch per process ({d.batch_size})")
    g.add_argument("--block-size", type=int, default=None, help="window length, at most n_positions (n_positions)")
    g.add_argument("--grad-accum", type=int, default=d.grad_accum, help=f"micro-steps per step ({d.grad_accum})")
    g.add_argument(
        "--stop-at",
        type=int,
        default=None,
        metavar="N",
        help="stop after step N with a resumable state; the schedule still spans --steps",
    )
    g = p.add_argument_group("schedule and optimizer")
    g.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate ({d.lr})")
    g.add_argument("--min-lr", type=float, default=None, help="learning rate at the last step (lr / 10)")
    g.add_argument("--warmup", type=int, default=d.warmup, help=f"linear warmup steps ({d.warmup})")
    g.add_argument("--schedule", choices=("cosine", "constant"), default=d.schedule, help="after warmup (cosine)")
    g.add_argument("--beta1", type=float, default=d.beta1, help=f"AdamW beta1 ({d.beta1})")
    g.add_argument("--beta2", type=float, default=d.beta2, help=f"AdamW beta2 ({d.beta2})")
    g.add_argument("--eps", type=float, default=d.eps, help=f"AdamW eps ({d.eps})")
    g.add_argument(
        "--weight-decay", type=float, default=d.weight_decay, help=f"on weights of 2+ dims only ({d.weight_decay})"
    )
    g.add_argument("--clip", type=float, default=d.clip, help=f"gradient norm clip, 0 for none ({d.clip})")
    g = p.add_argument_group("model options")
    g.add_argument("--dropout", type=float, default=None, help="every dropout rate (default: the checkpoint's)")
    g.add_argument("--grad-checkpointing", action="store_true", help="recompute blocks in backward: less memory")
    g.add_argument(
        "--kernels",
        choices=["reference", "fast"],
        default=d.kernels,
        help="reference: transformers' arithmetic op for op (default); fast: one-kernel GELU and the head fused with "
        "the loss (faster, less memory, gradients within transformers' own noise: docs/training.md)",
    )
    g = p.add_argument_group("evaluation and saving")
    g.add_argument("--eval-every", type=int, default=d.eval_every, help=f"steps between val losses ({d.eval_every})")
    g.add_argument("--eval-batches", type=int, default=d.eval_batches, help=f"batches per val loss ({d.eval_batches})")
    g.add_argument("--save-every", type=int, default=d.save_every, help="steps between checkpoints (0: at the end)")
    g.add_argument("--sample-every", type=int, default=d.sample_every, help="steps between samples in the log (0)")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=d.seed, help=f"seed of the batches, dropout and init ({d.seed})")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=d.dtype,
        help="float32; bf16 (autocast); fp16 (autocast + grad scaler, CUDA)",
    )
    g.add_argument(
        "--skip-nonfinite", action="store_true", help="skip a step whose loss or gradients are NaN/Inf (default: stop)"
    )
    g.add_argument("--json", metavar="PATH", help="write the run's summary as JSON")
    g.add_argument("--progress", action="store_true", help="draw the progress bar even when stderr is not a TTY")
    g.add_argument("--no-plot", action="store_true", help="do not write OUT/loss.png (needs matplotlib)")
    g.add_argument("--no-memory-check", action="store_true", help="start even if the memory estimate does not fit")
    p.set_defaults(func=run)


class Bar:
    """One stderr line redrawn in place: step, loss, lr, tok/s, ETA."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.t0 = time.perf_counter()

    def update(self, r: dict[str, Any]) -> None:
        if not self.enabled:
            return
        done = r["step"] - self.start
        left = self.total - r["step"]
        spent = time.perf_counter() - self.t0
        eta = spent / done * left if done else 0.0
        width = 24
        fill = int(width * r["step"] / self.total)
        val = f" val {r['val_loss']:.4f}" if "val_loss" in r else ""
        sys.stderr.write(
            f"\rstep {r['step']}/{self.total} [{'#' * fill}{'.' * (width - fill)}] loss {r['train_loss']:.4f}{val} "
            f"lr {r['lr']:.2e} {r['tokens_per_s']:,.0f} tok/s ETA {eta:.0f}s "
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def require_matplotlib() -> None:
    from ..errors import UsageError

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(
            "OUT/loss.png needs matplotlib, which is not installed: pip install 'gpt2-port[plot]' (or pass --no-plot)"
        ) from None


def plot_loss(records: list[dict], path: Path) -> None:
    """Train loss per step and val loss where evaluated, written atomically."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..util import atomic_write_bytes

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["train_loss"] for r in records], label="train loss", lw=1)
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _train_args(a: argparse.Namespace):  # noqa: ANN202
    from ..train import TrainArgs

    return TrainArgs(
        steps=a.steps,
        batch_size=a.batch_size,
        block_size=a.block_size,
        grad_accum=a.grad_accum,
        lr=a.lr,
        min_lr=a.min_lr,
        warmup=a.warmup,
        schedule=a.schedule,
        beta1=a.beta1,
        beta2=a.beta2,
        eps=a.eps,
        weight_decay=a.weight_decay,
        clip=a.clip,
        dropout=a.dropout,
        grad_checkpointing=a.grad_checkpointing,
        kernels=a.kernels,
        eval_every=a.eval_every,
        eval_batches=a.eval_batches,
        save_every=a.save_every,
        sample_every=a.sample_every,
        seed=a.seed,
        dtype=a.dtype,
        skip_nonfinite=a.skip_nonfinite,
        stop_at=a.stop_at,
    )


def _scratch_config(init: str):  # noqa: ANN202
    from ..config import preset, read_config_json
    from ..errors import UsageError

    p = Path(init)
    if p.is_file():
        return read_config_json(p)
    if p.is_dir() and (p / "config.json").is_file():
        return read_config_json(p / "config.json")
    try:
        return preset(init)
    except Exception:
        raise UsageError(
            f"--init {init!r} with --from-scratch: expected a size preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl) "
            "or a config.json"
        ) from None


def _init_config(init: str):  # noqa: ANN202
    """The config of --init without loading its weights (for the resume check), or None when only a load tells."""
    from ..config import read_config_json

    p = Path(init)
    if p.is_dir() and (p / "config.json").is_file():
        return read_config_json(p / "config.json")
    return None


def _load(path: str):  # noqa: ANN202
    """A checkpoint for training; its load report kept, so save_pretrained copies its tokenizer files along."""
    from ..load import from_pretrained

    model, report = from_pretrained(path)
    model.load_report = report
    return model


def run(args: argparse.Namespace) -> int:

    from .. import distributed, trainer_state
    from ..data import open_split
    from ..errors import UsageError
    from ..load import parse_device
    from ..model import GPT2
    from ..train import LOG_FILE, Callbacks, Trainer, check_memory, check_out_dir, prepare_model, read_log, same_model
    from ..util import atomic_write_text, check_writable

    targs = _train_args(args)
    targs.validate()
    if args.resume is None and args.init is None:
        raise UsageError("--init MODEL is required (or --resume DIR to continue a run)")
    if args.from_scratch and args.init is None:
        raise UsageError("--from-scratch needs --init: a size preset (gpt2, ...) or a config.json")
    if args.out is None and args.resume is None:
        raise UsageError("--out DIR is required (it receives the model, the trainer state and log.jsonl)")
    out = Path(args.out if args.out is not None else args.resume)
    dist = distributed.from_env()
    device = distributed.device_for(dist, parse_device(args.device))
    if dist.is_main:
        check_out_dir(out)
        if args.json:
            check_writable(args.json)
        if not args.no_plot:
            require_matplotlib()
    if args.resume is None and (out / trainer_state.STATE_JSON).exists():
        raise UsageError(
            f"--out {out}: holds a training run already; continue it with --resume {out}, or choose another --out"
        )
    state = None
    if args.resume is not None:
        state = trainer_state.load(args.resume)
        if args.init is not None:
            cfg = _scratch_config(args.init) if args.from_scratch else _init_config(args.init)
            if cfg is not None:
                same_model(cfg, state.model_config, f"--resume {args.resume}")
        model = _load(args.resume)
    elif args.from_scratch:
        model = GPT2(_scratch_config(args.init)).init_weights(targs.seed)
    else:
        model = _load(args.init)
    cfg = model.config
    block = targs.block_size or cfg.n_positions
    if block > cfg.n_positions:
        raise UsageError(f"--block-size {block} is larger than the model's context n_positions={cfg.n_positions}")
    train_data = open_split(args.data, "train", cfg.vocab_size, block)
    val_data = None
    if (Path(args.data) / "val.bin").is_file():
        val_data = open_split(args.data, "val", cfg.vocab_size, block)
    elif dist.is_main:
        sys.stderr.write(f"note: {args.data} has no val.bin: no validation loss, no OUT/best\n")
    mem = None if args.no_memory_check else check_memory(cfg, targs, block, device, dist)
    tokenizer = None
    if targs.sample_every:
        from ..tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer or args.resume or (args.init if Path(args.init).is_dir() else None))
    distributed.init(dist, device)
    try:
        prepare_model(model, targs, device)
        bar = Bar(targs.steps, state.step if state else 0, dist.is_main and (sys.stderr.isatty() or args.progress))

        def on_step(r: dict) -> None:
            bar.update(r)
            if "sample" in r:
                bar.close() if bar.enabled else None
                sys.stderr.write(f"sample at step {r['step']}: {r['sample']!r}\n")

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
            callbacks=Callbacks(on_step=on_step),
        )
        if dist.is_main and mem is not None:
            sys.stderr.write(
                f"memory: estimate {mem['detail']} of {mem['available_bytes'] / 2**30:.1f} GiB available; "
                f"global batch {trainer.global_batch} x {block} tokens on {dist.world_size} process(es), {device}\n"
            )

        def on_signal(signum: int, frame: object) -> None:
            trainer.request_stop()
            signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops at once

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        try:
            result = trainer.run()
        finally:
            bar.close()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    finally:
        distributed.shutdown(dist)
    at_stop = result.interrupted and targs.stop_at is not None and result.step >= targs.stop_at
    if not dist.is_main:
        return 130 if result.interrupted and not at_stop else 0
    if not args.no_plot:
        plot_loss(read_log(out / LOG_FILE, result.step), out / "loss.png")
    summary = {
        "out": str(out),
        "start_step": result.start_step,
        "step": result.step,
        "steps": targs.steps,
        "interrupted": result.interrupted,
        "train_loss": result.train_loss,
        "val_loss": result.val_loss,
        "best_val_loss": result.best_val_loss,
        "best_step": result.best_step,
        "elapsed_s": result.elapsed_s,
        "tokens_per_s": result.tokens_per_s,
        "global_batch": trainer.global_batch,
        "block_size": block,
        "world_size": dist.world_size,
        "skipped_steps": result.skipped_steps,
        "peak_rss_mb": _peak_rss_mb(),
        "memory_estimate_mb": mem["estimate_bytes"] / 2**20 if mem is not None else None,
    }
    if args.json:
        atomic_write_text(args.json, json.dumps(summary, indent=2) + "\n")
    if at_stop:
        print(
            f"stopped at step {result.step}/{targs.steps} (--stop-at): state saved in {out}; continue with "
            f"gpt2-port train --resume {out} --data {args.data} --steps {targs.steps}"
        )
        return 0
    if result.interrupted:
        print(
            f"interrupted at step {result.step}/{targs.steps}: state saved in {out}; continue with "
            f"gpt2-port train --resume {out} --data {args.data} --steps {targs.steps}"
        )
        return 130
    val = "" if result.val_loss is None else f", val loss {result.val_loss:.4f}"
    best = "" if result.best_step is None else f" (best {result.best_val_loss:.4f} at step {result.best_step})"
    tl = "n/a" if result.train_loss is None else f"{result.train_loss:.4f}"
    print(
        f"trained steps {result.start_step}->{result.step} in {result.elapsed_s:.1f}s: train loss {tl}{val}{best}, "
        f"{result.tokens_per_s:,.0f} tok/s; model in {out}" + (f", best in {out / 'best'}" if result.best_step else "")
    )
    return 0


def _peak_rss_mb() -> float:
    """VmHWM: the peak RSS of this program (ru_maxrss would carry over the peak of a parent that forked it)."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
