"""DDP through torchrun on CPU (gloo): 2 processes train the model 1 process trains with twice the accumulation."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import weights

from gpt2_port.cli import main
from gpt2_port.cli.train_settings import load_checkpoint
from gpt2_port.config import GPT2Config
from gpt2_port.errors import UsageError
from gpt2_port.io.demo import write_demo_checkpoint
from gpt2_port.train import TrainArgs, Trainer, prepare_model
from gpt2_port.train import state as trainer_state
from gpt2_port.train.data import open_split
from gpt2_port.train.distributed import Dist

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
SMALL = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=512)
COMMON = ["--batch-size", "2", "--block-size", "16", "--dropout", "0.1", "--no-plot", "--eval-batches", "2"]
COMMON += ["--eval-every", "2", "--device", "cpu", "--seed", "3"]
# 2 processes sum their gradients in another order than 1 process accumulating them: float32 noise only.
# Worst seen over 4 steps: 1.2e-7 relative on the loss, 3e-7 on the weights (tiny model, CPU).
LOSS_REL = 1e-5
WEIGHT_ATOL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, Path]:
    from gpt2_port.io.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("ddp")
    enc = load_tokenizer(tokenizer_dir).enc
    ids = np.array(enc.encode_ordinary(CORPUS.read_text()[:60000]), dtype=np.int64) % SMALL.vocab_size
    data = d / "data"
    data.mkdir()
    ids[:12000].astype("<u2").tofile(data / "train.bin")
    ids[12000:].astype("<u2").tofile(data / "val.bin")
    return write_demo_checkpoint(d / "ck", config=SMALL, seed=5), data


# A sitecustomize that marks each torchrun worker (RANK set) reaching the interpreter's exit-time teardown.
_EXIT_PROBE = """import atexit, os
if os.environ.get("RANK") is not None:
    mark = os.path.join(os.environ["EXIT_PROBE_DIR"], f"rank{os.environ['RANK']}-{os.getpid()}")
    atexit.register(lambda: open(mark, "w").close())
"""


def _with_exit_probe(env: dict[str, str], where: Path) -> dict[str, str]:
    (where / "sitecustomize.py").write_text(_EXIT_PROBE)
    return dict(env, PYTHONPATH=f"{where}{os.pathsep}{env['PYTHONPATH']}", EXIT_PROBE_DIR=str(where))


def _torchrun_env(tmp: Path) -> dict[str, str]:
    """The environment of a torchrun job: this checkout importable, one thread a process, and temporary files
    (torchrun's torchelastic_* log folder among them) under `tmp`, not left in the system's."""
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp))


def launch(n: int, *target: str) -> subprocess.CompletedProcess:
    """torchrun with n CPU processes running `target` (a script and its arguments, or -m MODULE ...). Every worker
    must leave without the exit-time teardown, where gloo's threads aborted a finished run now and then."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *target]
    with tempfile.TemporaryDirectory() as probe:
        env = _with_exit_probe(_torchrun_env(Path(probe)), Path(probe))
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(p.name for p in Path(probe).glob("rank*")) == []
    return r


def test_the_exit_probe_sees_a_worker_that_leaves_through_the_teardown(tmp_path: Path) -> None:
    """The probe works: a process with RANK set that exits normally (here `gpt2-port --version`, which joins no
    process group and so exits as usual) is marked."""
    env = _with_exit_probe(dict(os.environ, PYTHONPATH=str(REPO), RANK="0"), tmp_path)
    r = subprocess.run([sys.executable, "-m", "gpt2_port", "--version"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and len(list(tmp_path.glob("rank0-*"))) == 1


def torchrun(n: int, *argv: str) -> subprocess.CompletedProcess:
    return launch(n, "-m", "gpt2_port", "train", *argv)


def one_process_accumulating(ck: Path, data: Path, out: Path, *extra: str, accum: int = 2) -> None:
    """The run 2 processes must equal: 1 process, 4 steps, --grad-accum `accum`, twice the 2 processes' (the same
    global batch)."""
    argv = ["train", "--init", str(ck), "--data", str(data), "--out", str(out), "--steps", "4"]
    assert main([*argv, "--grad-accum", str(accum), *extra, *COMMON]) == 0


def losses(out: Path) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "log.jsonl").read_text().splitlines()]


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= LOSS_REL * abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize(("kernels", "compiled", "accum"), [("reference", False, 1), ("fast", True, 2)])
def test_two_gloo_processes_equal_one_process_with_twice_the_accumulation(
    setup, tmp_path: Path, monkeypatch, kernels: str, compiled: bool, accum: int
) -> None:
    """The fast kernels' case runs the 2 processes with --compile (DDP's module compiled without fullgraph: its
    bucketing splits the graph; aot_eager: the graphs inductor would get, run by eager kernels), --grad-accum 2
    (the first micro-step under DDP's no_sync, its gradients summed across the processes only with the second's)
    and --overlap (each process queues step k + 1 before it reads step k, as on CUDA) against 1 eager process
    accumulating 4."""
    ck, data = setup
    two, one = tmp_path / "two", tmp_path / "one"
    monkeypatch.setenv("GPT2_PORT_COMPILE_BACKEND", "aot_eager")
    r = torchrun(
        2,
        "--init",
        str(ck),
        "--data",
        str(data),
        "--out",
        str(two),
        "--steps",
        "4",
        "--json",
        str(tmp_path / "s.json"),
        "--kernels",
        kernels,
        *(["--compile", "--overlap"] if compiled else []),
        "--grad-accum",
        str(accum),
        *COMMON,
    )
    assert r.stdout.count("trained steps 0->4") == 1  # only rank 0 prints (and writes)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["world_size"] == 2 and summary["compile"] is compiled
    one_process_accumulating(ck, data, one, "--kernels", kernels, accum=2 * accum)
    a, b = losses(two), losses(one)
    assert len(a) == 4 and close(a, b), (a, b)
    assert len(set(a)) == 4  # the steps did train
    wa, wb = weights(two), weights(one)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=WEIGHT_ATOL)


def test_resume_works_with_another_number_of_processes(setup, tmp_path: Path) -> None:
    ck, data = setup
    run, ref = tmp_path / "run", tmp_path / "ref"
    torchrun(2, "--init", str(ck), "--data", str(data), "--out", str(run), "--steps", "4", "--stop-at", "2", *COMMON)
    assert trainer_state.load(run).world_size == 2
    assert main(["train", "--resume", str(run), "--data", str(data), "--steps", "4", "--grad-accum", "2", *COMMON]) == 0
    one_process_accumulating(ck, data, ref)
    assert close(losses(run), losses(ref)), (losses(run), losses(ref))


_TRAINER_HEAD = """
import json, os, sys
from pathlib import Path
import torch
from gpt2_port.model import from_pretrained
from gpt2_port.train import Trainer, TrainArgs, distributed, prepare_model
from gpt2_port.train.data import open_split

ck, data, out = sys.argv[1:4]
d = distributed.from_env()
distributed.init(d, torch.device("cpu"))
model, _ = from_pretrained(ck)
args = TrainArgs(steps=STEPS, batch_size=2, block_size=16, grad_accum=ACCUM, dropout=0.0, eval_every=0)
prepare_model(model, args, torch.device("cpu"))
t = Trainer(model, args, open_split(data, "train", model.config.vocab_size, 16), None, out, "cpu", d)
"""


# One file per rank (two processes printing to one pipe can interleave their lines), then leave without the
# interpreter's and C++'s exit-time teardown: with a Python comm hook registered, torch's exit aborted about 1 run in
# 150 after the last line had run ("terminate called without an active exception" from a C++ thread, no Python frame;
# 5 of 742 runs of the sync script on 2 CPU processes). `gpt2-port train` leaves the same way (cli.main.run), after
# one of its runs had aborted so.
_TRAINER_TAIL = """
Path(out).mkdir(parents=True, exist_ok=True)
(Path(out) / f"rank{d.rank}.json").write_text(json.dumps({"rank": d.rank, **result}))
distributed.shutdown(d)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _trainer_script(steps: int, grad_accum: int, body: str) -> str:
    """A torchrun worker: a Trainer (`t`, its args `args`, the process group `d`) over argv's checkpoint, data and
    out, then `body`, which leaves its findings in the dict `result` (written to OUT/rank{r}.json)."""
    return _TRAINER_HEAD.replace("STEPS", str(steps)).replace("ACCUM", str(grad_accum)) + body + _TRAINER_TAIL


def _run_workers(script: str, setup: tuple[Path, Path], tmp_path: Path) -> list[dict]:
    """`script` in 2 torchrun processes over the fixture's checkpoint and data: each rank's `result`, by rank."""
    ck, data = setup
    path = tmp_path / "worker.py"
    path.write_text(script)
    launch(2, str(path), str(ck), str(data), str(tmp_path / "out"))
    ranks = [json.loads(f.read_text()) for f in sorted((tmp_path / "out").glob("rank*.json"))]
    assert sorted(x["rank"] for x in ranks) == [0, 1]
    return ranks


_SYNC_SCRIPT = _trainer_script(
    2,
    3,
    """
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
micro = []  # the micro-step each batch belongs to (its copy to the device is made before its forward)
get = t.batches.get
t.batches.get = lambda *a: micro.append(len(micro)) or get(*a)
synced = []  # the micro-step during whose backward DDP all-reduced a gradient bucket

def hook(state, bucket):
    synced.append(micro[-1] % args.grad_accum)
    return allreduce_hook(None, bucket)

t.net.register_comm_hook(None, hook)
for step in range(2):
    t.step(step)
result = {"micro": len(micro), "synced": synced}
""",
)


def test_gradients_are_synchronised_only_on_the_last_micro_step(setup, tmp_path: Path) -> None:
    """With --grad-accum 3, DDP's all-reduce runs during the third micro-batch's backward only (no_sync before it):
    the other two would send the gradients three times for nothing."""
    for x in _run_workers(_SYNC_SCRIPT, setup, tmp_path):
        assert x["micro"] == 7  # 2 steps x 3 micro-batches, and the third step's first batch sent ahead
        assert x["synced"] and set(x["synced"]) == {2}, x


_WAITS_SCRIPT = _trainer_script(
    3,
    2,
    """
import torch.distributed as tdist
# the checks of values that run only where reading them costs nothing (a CPU tensor) see a device's tensors here
import gpt2_port.model.fused, gpt2_port.model.gpt2
gpt2_port.model.gpt2.host_readable = gpt2_port.model.fused.host_readable = lambda t: False
reads, reduces = [], []
for name in ("tolist", "item", "__bool__", "__float__", "__int__", "__index__"):
    real = getattr(torch.Tensor, name)
    def counted(self, *a, _real=real, _name=name, **k):
        reads.append(_name)
        return _real(self, *a, **k)
    setattr(torch.Tensor, name, counted)
real_all_reduce = tdist.all_reduce
def all_reduce(*a, **k):
    reduces.append(1)
    return real_all_reduce(*a, **k)
tdist.all_reduce = all_reduce
steps = []
for step in range(3):
    if step == 1 and d.rank == 1:
        t.request_stop()  # one process asked to stop (its Ctrl-C): every process must stop after the same step
    reads.clear(); reduces.clear()
    t.step(step)
    stop = t._stop_requested()
    steps.append({"reads": list(reads), "reduces": len(reduces), "stop": stop})
result = {"steps": steps}
""",
)


def test_a_ddp_step_waits_once_and_carries_the_stop_vote_in_its_one_all_reduce(setup, tmp_path: Path) -> None:
    """Each step reads the device back once (loss, gradient norm and the stop vote in one transfer) and makes one
    all-reduce of its own (DDP's gradient buckets aside): the stop request of one process rides on it, and every
    process stops after the same step."""
    for x in _run_workers(_WAITS_SCRIPT, setup, tmp_path):
        assert [s["reads"] for s in x["steps"]] == [["tolist"]] * 3, x
        assert [s["reduces"] for s in x["steps"]] == [1, 1, 1], x
        assert [s["stop"] for s in x["steps"]] == [False, True, True], x


_OVERLAPPED_STOP_SCRIPT = _trainer_script(
    10,
    1,
    """
t.overlap = True  # as on CUDA: step k + 1 queued before step k is read
order = []
queue, finish = Trainer._queue_step, Trainer._finish_step

def queued(self, step):
    if step == 2 and d.rank == 1:
        self.request_stop()  # process 1's Ctrl-C while it queues step 3: its vote rides on step 3's all-reduce
    order.append(f"q{step + 1}")
    return queue(self, step)

def finished(self, q):
    order.append(f"r{q.step + 1}")
    return finish(self, q)

Trainer._queue_step, Trainer._finish_step = queued, finished
res = t.run()
result = {"step": res.step, "interrupted": res.interrupted, "order": order}
""",
)


def test_overlapped_processes_take_a_stop_vote_after_the_same_step(setup, tmp_path: Path) -> None:
    """Overlapped steps under DDP: process 1 asks to stop while it queues step 3; the vote rides on step 3's
    all-reduce and is read with step 3, when step 4 is already queued on both, so both finish step 4, queue nothing
    more and stop there together (the same queueing and reading on each: no collective left waiting)."""
    ranks = _run_workers(_OVERLAPPED_STOP_SCRIPT, setup, tmp_path)
    want = "q1 q2 r1 q3 r2 q4 r3 r4"
    assert [(x["step"], x["interrupted"], " ".join(x["order"])) for x in ranks] == [(4, True, want)] * 2, ranks


@dataclass(frozen=True)
class _OneOf(Dist):
    """Process `rank` of `world_size` seen alone: its all-reduce returns its own share (no process group)."""

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


@pytest.mark.parametrize(("world", "eval_batches"), [(3, 4), (2, 1)])
def test_each_process_evaluates_whole_batches_and_their_shares_add_up_to_one_processs_loss(
    setup, tmp_path: Path, world: int, eval_batches: int
) -> None:
    """The validation batches are dealt to the processes whole: every forward has --batch-size rows (one compiled
    shape), each batch is one the single process evaluates, a process left without a batch adds 0 (not NaN), and the
    shares add up to the single process's mean loss."""
    ck, data = setup
    model = load_checkpoint(ck)
    args = TrainArgs(steps=1, batch_size=2, block_size=16, eval_batches=eval_batches, dropout=0.0)
    prepare_model(model, args, torch.device("cpu"))
    t = Trainer(
        model, args, open_split(data, "train", SMALL.vocab_size, 16), open_split(data, "val", 512, 16), tmp_path
    )
    whole = t.evaluate()
    rows: list[list[int]] = []
    forward = t.eval_forward
    t.eval_forward = lambda x, **k: rows[-1].append(x.shape[0]) or forward(x, **k)
    shares = []
    for rank in range(world):
        object.__setattr__(t, "dist", _OneOf(rank=rank, world_size=world))
        rows.append([])
        shares.append(t.evaluate())
    assert all(math.isfinite(s) for s in shares), shares
    assert [len(r) for r in rows] == [len(range(eval_batches)[r::world]) for r in range(world)]
    assert {n for r in rows for n in r} == {args.batch_size}
    assert sum(shares) == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize(
    ("rank", "verbose", "level"), [("1", False, logging.ERROR), ("1", True, None), ("0", False, None)]
)
def test_only_rank_0_logs_warnings(monkeypatch, tmp_path: Path, rank: str, verbose: bool, level: int | None) -> None:
    """The processes after the first log errors only (the warnings are the same in every process; rank 0 logs them),
    unless -v. Checked before the process group is joined: a --resume directory that is missing stops the run."""
    lib = logging.getLogger("gpt2_port")
    before = lib.level
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        assert main([*(["-v"] if verbose else []), "train", "--resume", str(tmp_path / "missing")]) == 2
        assert lib.level == (level if level is not None else before)
    finally:
        lib.setLevel(before)  # setLevel, which also clears the loggers' cached levels


@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_more_processes_than_gpus_is_refused_in_one_line(monkeypatch, tmp_path: Path, capsys, device: str) -> None:
    """torchrun's `--nproc_per_node 2` on a machine with one GPU: `--device auto` picks CUDA and process 1 would ask
    for cuda:1, which is not there. Every process refuses before anything is read or joined (CUDA stood in for: the
    counts are all the check reads)."""
    from gpt2_port.train.distributed import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    argv = ["train", "--init", "gpt2", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--device", device]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "torchrun started 2 processes on this machine, which has 1 GPU" in err
    assert "--nproc_per_node 1" in err and "--device cpu" in err and not (tmp_path / "o").exists()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the GPUs hidden from the process are named
    with pytest.raises(UsageError, match=r"has 1 GPU shown to it \(CUDA_VISIBLE_DEVICES=3\)"):
        device_for(Dist(1, 2, 1, 2), torch.device("cuda"))
    with pytest.raises(UsageError, match="started 3 processes"):  # a launcher that sets no LOCAL_WORLD_SIZE
        device_for(Dist(2, 3, 2, 1), torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # one GPU a process: process 1 takes cuda:1
    assert device_for(Dist(1, 2, 1, 2), torch.device("cuda")) == torch.device("cuda", 1)
    assert device_for(Dist(1, 2, 1, 2), torch.device("cpu")) == torch.device("cpu")


_OOM_ON_RANK_1 = """import os, sys, torch
from gpt2_port.train.loop import Trainer
real = Trainer._queue_step
def step(self, s):
    if s == 2 and os.environ["RANK"] == "1":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 1 has 0.2 GiB free.")
    return real(self, s)
Trainer._queue_step = step
from gpt2_port.cli.main import run
sys.argv = ["gpt2-port", *sys.argv[1:]]
run()
"""


def test_one_process_out_of_memory_is_its_one_line_and_the_others_say_a_peer_stopped(setup, tmp_path: Path) -> None:
    """Process 1 runs out of memory in step 3 (a stand-in): it says so in one line, and process 0, whose all-reduce
    loses its peer (gloo: "Connection reset by peer"), says another process stopped, not an internal error."""
    ck, data = setup
    script = tmp_path / "oom.py"
    script.write_text(_OOM_ON_RANK_1)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    cmd += ["train", "--init", str(ck), "--data", str(data), "--out", str(tmp_path / "o"), "--steps", "4", *COMMON]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_torchrun_env(tmp_path), timeout=300, cwd=REPO)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("gpt2-port train:")]
    assert len(lines) == 2 and "internal error" not in r.stderr, r.stderr[-3000:]
    assert any("error: CUDA out of memory. Tried to allocate 1.50 GiB in step 3 (" in ln for ln in lines), lines
    assert any(ln.endswith("another process of this torchrun job stopped, so this one cannot go on (that process's "
                           "error says why)") for ln in lines), lines  # fmt: skip
