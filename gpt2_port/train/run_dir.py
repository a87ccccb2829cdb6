"""A run's output directory (--out): the last saved step in the official layout with the trainer state beside it,
`best/` (the lowest validation loss), `log.jsonl` (one record per step). Only the process of rank 0 writes.

Each checkpoint is written into a hidden staging directory inside --out and its files moved into place, the trainer
state's JSON last (files.commit_files), so no file is ever half-written and a state never sits beside another step's
weights. A directory moved or deleted while training, or a write that fails (a full disk, lost permissions), stops
the run with one line naming --out.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import UsageError
from ..files import append_line, atomic_write_text, commit_files, replace_dir, staging_dir
from . import state as trainer_state

LOG_FILE = "log.jsonl"
BEST_DIR = "best"


def read_log(path: Path, upto: int) -> list[dict]:
    """The records of log.jsonl up to step `upto` (a resume rewrites the log from there)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            r = json.loads(line)
            if isinstance(r, dict) and isinstance(r.get("step"), int) and r["step"] <= upto:
                out.append(r)
    return out


class RunDir:
    def __init__(self, out: str | Path, writes: bool = True) -> None:
        self.out = Path(out)
        self.writes = writes  # False on every process but rank 0

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Around every write into --out: a vanished directory or a failed write is one line naming --out."""
        if not self.out.is_dir():
            raise UsageError(
                f"--out {self.out}: the directory is gone (moved or deleted while training); stopped without "
                "writing anything more (to continue, --resume the directory where it is now)"
            )
        try:
            yield
        except OSError as e:
            raise UsageError(f"--out {self.out}: cannot write there any more ({e.strerror or e})") from None

    def start(self, records: list[dict]) -> None:
        """Create --out and write the log as it stands (a resume continues it from its step)."""
        if not self.writes:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        self.rewrite_log(records)

    def rewrite_log(self, records: list[dict]) -> None:
        if self.writes:
            with self.writing():
                atomic_write_text(self.out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in records))

    def append_log(self, record: dict) -> None:
        if self.writes:
            with self.writing():
                append_line(self.out / LOG_FILE, json.dumps(record))

    def save(self, write_model: Callable[[Path], None], state: trainer_state.TrainerState) -> None:
        """The model (written by `write_model` into the directory it is given) and the trainer state, into --out."""
        if not self.writes:
            return
        with self.writing(), staging_dir(self.out, f"step-{state.step}") as tmp:
            write_model(tmp)
            trainer_state.save(state, tmp)
            commit_files(tmp, self.out, last=trainer_state.STATE_JSON)

    def save_best(self, write_model: Callable[[Path], None]) -> Path:
        if self.writes:
            with self.writing(), staging_dir(self.out, "best") as tmp:
                write_model(tmp)
                replace_dir(tmp, self.out / BEST_DIR)
        return self.out / BEST_DIR
