"""The settings of a `gpt2-port train` run: the flags given, the saved settings a resume continues with (each override
that changes the run named), and the model a run starts from (a checkpoint, or a new one from a preset or config)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any


def given_settings(a: argparse.Namespace) -> dict[str, Any]:
    """The TrainArgs fields set by flags on this command line. The flags' defaults are None, so a resume can tell a
    flag given again (an override) from one left out (the saved value stands); TrainArgs holds the real defaults."""
    from ..train.args import TrainArgs

    names = [f.name for f in dataclasses.fields(TrainArgs)]
    return {k: getattr(a, k) for k in names if getattr(a, k, None) is not None}


def scratch_config(init: str):  # noqa: ANN202
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


def init_config(init: str):  # noqa: ANN202
    """The config of --init without loading its weights (for the resume check), or None when only a load tells."""
    from ..config import read_config_json

    p = Path(init)
    if p.is_dir() and (p / "config.json").is_file():
        return read_config_json(p / "config.json")
    return None


def load_checkpoint(path: str):  # noqa: ANN202
    """A checkpoint for training; its load report kept, so save_pretrained copies its tokenizer files along."""
    from ..errors import UsageError
    from ..model import from_pretrained

    if Path(path).is_file() and path.endswith(".json"):
        raise UsageError(
            f"--init {path}: a config.json is not a checkpoint; add --from-scratch to train a new model of that shape"
        )
    model, _ = from_pretrained(path)
    return model


def run_settings(args: argparse.Namespace, state, dist, warn) -> Any:  # noqa: ANN001, ANN401
    """The run's TrainArgs: the defaults with the flags given (a new run), or the saved settings with the flags given
    again (a resume), each override that changes the run named through `warn`."""
    from ..errors import UsageError
    from ..train.args import TrainArgs, resume_changes
    from ..train.state import STATE_JSON

    given = given_settings(args)
    if state is None:
        targs = TrainArgs(**given)
    else:
        saved = TrainArgs.from_saved(state.args, f"{args.resume}/{STATE_JSON}")
        targs = dataclasses.replace(saved, **given)
        state.check_steps(targs.steps, args.resume)  # before any warning about the change: nothing would run
        if state.step == targs.steps:
            raise UsageError(
                f"--resume {args.resume}: the run has done its {targs.steps} steps already (nothing to resume); pass "
                f"--steps N with N > {targs.steps} to train on"
            )
        for line in resume_changes(saved, targs, state.world_size, dist.world_size):
            warn(line)
        if "data" not in given and saved.data is not None and not Path(saved.data).is_dir():
            raise UsageError(
                f"--resume {args.resume}: the run's data directory {saved.data} is gone (moved or deleted); pass "
                "--data DIR where it is now"
            )
        data = given.get("data", saved.data)
        saved_tokens, now_tokens = state.train_tokens, train_tokens(data) if data is not None else None
        if saved_tokens is not None and now_tokens is not None and saved_tokens != now_tokens:
            moved = saved.data is None or Path(saved.data).resolve() != Path(data).resolve()
            warn(
                f"resuming with --data {data} ({now_tokens:,} train tokens) where the saved run used {saved.data} "
                f"({saved_tokens:,}): other data, so the run is no longer the one an uninterrupted run would have been"
                if moved
                else f"the data in {data} changed since the run was saved: train.bin holds {now_tokens:,} tokens, "
                f"the run was trained on {saved_tokens:,} (prepared again?), so the run is no longer the one an "
                "uninterrupted run would have been"
            )
    targs.validate()
    if targs.data is None:
        raise UsageError("--data DIR is required (the output of gpt2-port prepare: train.bin, val.bin)")
    targs.data = str(targs.data)
    return targs


def train_tokens(data: str) -> int | None:
    f = Path(data) / "train.bin"
    return f.stat().st_size // 2 if f.is_file() else None
