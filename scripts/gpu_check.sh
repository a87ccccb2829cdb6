#!/usr/bin/env bash
# The GPU half of the project's checks, in a few long commands, on a machine with CUDA whose python already has torch,
# transformers and safetensors (no network needed: the checkpoints are random weights in the official layout, written
# there). Each phase writes its log and its JSON/Markdown/PNG into RESULTS and prints a one-line verdict.
#
#   scripts/gpu_check.sh PHASE [PHASE ...]
#     tests     the `cuda` tests (tests/test_cuda.py)
#     suite     the whole suite on that machine (its CPU and its torch: the image's torch 2.11 and transformers 5.17
#               are pyproject's floors, which CI tests too)
#     parity    gpt2-port parity --device cuda: 1.5B float32 forward (expect 0 at every forward point), 124M
#               backward with 10 AdamW steps (reference kernels: bit-identical), 124M bf16; gpt2-port eval --check
#               on 100 kB of tiny shakespeare, 124M, float32 and bf16 (each NLL's difference from transformers
#               beside transformers' own eager-to-sdpa floor); then 124M's forward and fast-kernel backward reports
#     train     python -m benchmarks.gpu train --sizes gpt2 (tokens/s, MFU, peak memory beside transformers, eager
#               and compiled), then the fused head padded and not, its chunk sizes, and compiled
#               (benchmarks.head_padding --compile)
#     train-xl  the eager sides and `train`'s own loop for gpt2-xl (its 48-layer compiles would not fit one call)
#     decode    python -m benchmarks.gpu decode --sizes gpt2 (tokens/s beside transformers' generate; ours also
#               compiled first, as `generate --compile` runs it: inductor's compile runs in its warm-up, after the
#               loops before it were timed and saved, and DECODE_ARGS=--no-compile leaves it out)
#     decode-xl the same for gpt2-xl, bf16 (sampled batches of 8 and 32: with the 6.4 GB checkpoint written and
#               transformers' 48-layer static cache compiled, 64 rows too might not fit one call; with
#               DECODE_ARGS="--no-hf-compile --batches=" batch 1 alone beside transformers eager: 57 s on an H200
#               before ours compiled joined it, whose 48-layer compile is not yet timed)
#     decode-long  124M bf16, batch 1, 1,000 new tokens (a 1,024-slot cache: the attention kernel split over
#               programs, and the row `ours, attention unsplit` beside it), ours uncompiled, transformers eager and
#               with its static cache (not compiled), 2 rounds
#     profile   python -m benchmarks.gpu_profile --sizes gpt2: where a training step's and a decode token's device
#               time goes (kernels per unit, time by kind, the top kernels), ours beside transformers, compiled
#     smoke     the same commands at toy sizes on the CPU (checks this script, not the GPU)
# Phases run in the order given. Device time is short (15 minutes a session, machine starts included, each call at
# most 10): one full call first, TESTS_ARGS=-vv TRAIN_ARGS=--key-only DECODE_ARGS="--dtypes bfloat16,float32"
# BUDGET_S=565 (under the call's limit) `tests train decode`, then at once DECODE_ARGS="--no-hf-compile --batches="
# with what is left (a machine idle for 30 s is given back; none starts with under 4 minutes left). On an H100
# (2026-11-28) the first took 444 s (tests 96, train 161, its head benchmark 30, decode 138) and `profile parity
# decode-xl` 352 s with the start's 33 s, decode-xl cut at its deadline after ours' row: 836 s of the 900 in all,
# none left for `train-xl` (102 s on an H200). Decode's attention rows, added since, add three generations a dtype
# (SDPA's memory-efficient kernel beside the step's own, cuDNN's in bf16/fp16, math), and `ours, cuBLAS matmuls` one
# more (the step's matmul kernels off).
# A step still running at the deadline
# (BUDGET_S after the start, default 570 s) is stopped, so the bundle after it is made; steps left after the deadline
# are named as not run. While a step runs, RESULTS is bundled every 60 s too; the benchmarks rewrite their JSON after
# every side and round, and `python -m benchmarks.gpu KIND --render-from JSON --markdown M --plot P` renders a
# cut-short one.
# Every invocation first writes RESULTS/env.log: python, torch, CUDA, the GPU, triton and a C compiler.
#
# Environment: RESULTS (default gpu-results), PYTHON (default python3), INSTALL=0 to skip `pip install -e .` (if it
# fails, the commands run from the checkout on PYTHONPATH), TRAIN_ARGS, DECODE_ARGS and TESTS_ARGS (more flags for
# benchmarks.gpu train / decode and for pytest in tests / suite; split on spaces, quotes not read: for example
# TRAIN_ARGS="--key-only --steps 10" DECODE_ARGS="--batches 8,32" TESTS_ARGS="-x --maxfail 3"),
# SHARED_FROM (default .gpu_shared where it exists; the tests need ../shared beside the checkout: GPT-2's BPE files and
# tiny shakespeare; where it is missing, a copy of it at SHARED_FROM is put there),
# OUT: the device machine's folder of files sent back (set there): after env.log and after every step the RESULTS
# folder is written to OUT/gpu-results.tgz, so a call cut off at its time limit still returns what was done (OUT
# itself returns only a few files). The benchmarks share the script's checkpoints (weights/).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEADLINE=$(($(date +%s) + ${BUDGET_S:-570}))
RESULTS=${RESULTS:-gpu-results}
SHARED_FROM=${SHARED_FROM:-$([ -d .gpu_shared ] && echo .gpu_shared)}
[ $# -gt 0 ] || { awk 'NR >= 6 { if (!/^#/) exit; sub(/^# ?/, ""); print }' "$0"; exit 2; }  # the comment above
for phase in "$@"; do
  case "$phase" in tests | suite | parity | train | train-xl | decode | decode-xl | decode-long | profile | smoke) ;; *) echo "gpu_check: unknown phase '$phase' (expected tests, suite, parity, train, train-xl, decode, decode-xl, decode-long, profile or smoke)" >&2; exit 2 ;; esac
done
mkdir -p "$RESULTS" weights

bundle() {  # bundle [WHO]: RESULTS as OUT/gpu-results.tgz where the device machine's OUT is set (another folder);
  # each writer its own part file: a step's end kills the 60 s loop, not a tar it has running, which must not
  # write into the part file the step's own bundle is writing
  [ -n "${OUT:-}" ] && [ -d "$OUT" ] || return 0
  [ "$(cd "$OUT" && pwd)" != "$(cd "$RESULTS" && pwd)" ] || return 0
  local part="$OUT/.gpu-results.tgz.${1:-step}"
  tar czf "$part" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")" &&
    mv -f "$part" "$OUT/gpu-results.tgz"  # whole: a kill mid-write keeps the last bundle
}

if [ "${INSTALL:-1}" = 1 ] && ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$RESULTS/install.log" 2>&1; then
  # an old setuptools or pip must not cost the call: run from the checkout, checks/ importable as gpt2_port_checks
  echo "gpu_check: pip install -e . failed, running from the checkout (PYTHONPATH); $RESULTS/install.log ends:" >&2
  tail -5 "$RESULTS/install.log" >&2
  pp="$(cd "$RESULTS" && pwd)/pythonpath"
  mkdir -p "$pp" && ln -sfn "$PWD/checks" "$pp/gpt2_port_checks"
  export PYTHONPATH="$PWD:$pp${PYTHONPATH:+:$PYTHONPATH}"
fi
G=("$PY" -m gpt2_port)
failed=0

step() {  # step NAME COMMAND...: run it until the deadline, its output into RESULTS/NAME.log, one line of verdict;
  # RESULTS bundled every 60 s while it runs and once after
  local name=$1 t0 rc left bundler
  shift
  t0=$(date +%s)
  left=$((DEADLINE - t0))
  if [ $left -lt 3 ]; then
    echo "== $name: not run (the deadline, ${BUDGET_S:-570} s after the start, has passed)" >&2
    failed=1
    return
  fi
  echo "== $name: $*" >&2
  (while sleep 60; do bundle loop; done) >/dev/null 2>&1 &  # no pipe of the caller held open by its sleep
  bundler=$!
  PYTHONUNBUFFERED=1 timeout -k 10 "$left" "$@" >"$RESULTS/$name.log" 2>&1
  rc=$?
  kill "$bundler" 2>/dev/null
  wait "$bundler" 2>/dev/null
  [ $rc -ne 124 ] || echo "== $name: stopped at the deadline; what it wrote is in $RESULTS" >&2
  echo "== $name: exit $rc in $(($(date +%s) - t0)) s (log $RESULTS/$name.log)" >&2
  [ $rc -eq 0 ] || { failed=1; tail -20 "$RESULTS/$name.log" >&2; }
  bundle
}

"$PY" - >"$RESULTS/env.log" 2>&1 <<'PYEOF'
import importlib.util, platform, shutil
import torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "| capability", torch.cuda.get_device_capability(0))
else:
    print("device: no CUDA")
for mod in ("triton", "transformers", "safetensors", "tiktoken", "matplotlib", "setuptools"):
    spec = importlib.util.find_spec(mod)
    print(mod, "missing" if spec is None else __import__(mod).__version__)
print("C compiler", shutil.which("cc") or shutil.which("gcc") or "missing")
PYEOF
echo "== env: $(tr '\n' ' ' <"$RESULTS/env.log")" >&2
bundle

shared() {  # the tests read ../shared: put the copy at SHARED_FROM there when it is missing
  if [ -n "${SHARED_FROM:-}" ] && [ ! -e ../shared ]; then cp -r "$SHARED_FROM" ../shared; fi
  [ -d ../shared/gpt2-tokenizer ] || echo "gpu_check: ../shared/gpt2-tokenizer is missing (copy ../shared to .gpu_shared and carry it): the tests that read it will fail" >&2
}
# shellcheck disable=SC2206  # word-split on purpose: a list of flags
TRAIN_EXTRA=(${TRAIN_ARGS:-})
# shellcheck disable=SC2206
DECODE_EXTRA=(${DECODE_ARGS:-})
# shellcheck disable=SC2206
TESTS_EXTRA=(${TESTS_ARGS:-})

eval_check() {  # eval_check DEVICE BYTES DTYPE...: gpt2-port eval --check of 124M on the first BYTES of tiny shakespeare
  local dev=$1 bytes=$2 dt
  shift 2
  shared
  head -c "$bytes" ../shared/data/tinyshakespeare/input.txt >"$RESULTS/eval-text.txt"
  for dt in "$@"; do
    step "eval-check-124m-$dev-$dt" "${G[@]}" eval weights/gpt2-random --text "$RESULTS/eval-text.txt" \
      --tokenizer ../shared/gpt2-tokenizer --device "$dev" --dtype "$dt" --check --no-progress \
      --json "$RESULTS/eval-check-124m-$dev-$dt.json"
  done
}

checkpoint() {  # checkpoint SIZE: weights/SIZE-random, written once
  [ -f "weights/$1-random/model.safetensors" ] || step "checkpoint-$1" "${G[@]}" demo-checkpoint --size "$1" --out "weights/$1-random"
}

for phase in "$@"; do
  case "$phase" in
    tests)
      shared
      # a failure shows its traceback (the CLI's one line would hide it); a test running past 150 s has every
      # thread's stack written to the log (pytest's faulthandler), so a hang names itself before the deadline
      step tests-cuda env GPT2_PORT_DEBUG=1 "$PY" -m pytest -q -m cuda -rs --durations=15 -o faulthandler_timeout=150 \
        "${TESTS_EXTRA[@]}"
      ;;
    suite)
      shared
      step tests-all "$PY" -m pytest -q -rs --durations=15 -o faulthandler_timeout=150 "${TESTS_EXTRA[@]}"
      ;;
    parity)
      checkpoint gpt2
      checkpoint gpt2-xl
      # what no `cuda` test shows first (the tests phase checks 124M's forward): 1.5B, the 124M backward and its
      # AdamW steps, bf16, eval --check; then 124M's forward report and the fast kernels' backward
      step parity-1.5b "${G[@]}" parity weights/gpt2-xl-random --device cuda --json "$RESULTS/parity-1.5b.json"
      step parity-124m-backward "${G[@]}" parity weights/gpt2-random --device cuda --backward --train-steps 10 \
        --json "$RESULTS/parity-124m-backward.json"
      step parity-124m-bf16 "${G[@]}" parity weights/gpt2-random --device cuda --dtype float32,bfloat16 --backward \
        --json "$RESULTS/parity-124m-bf16.json"
      eval_check cuda 100000 float32 bfloat16
      step parity-124m "${G[@]}" parity weights/gpt2-random --device cuda --json "$RESULTS/parity-124m.json"
      step parity-124m-backward-fast "${G[@]}" parity weights/gpt2-random --device cuda --backward --train-steps 10 \
        --kernels fast --json "$RESULTS/parity-124m-backward-fast.json"
      ;;
    train)
      checkpoint gpt2
      step bench-train "$PY" -m benchmarks.gpu train --sizes gpt2 --weights-dir weights --out "$RESULTS/train.json" \
        --markdown "$RESULTS/train.md" --plot "$RESULTS/train.png" "${TRAIN_EXTRA[@]}"
      step bench-head-padding "$PY" -m benchmarks.head_padding --device cuda --dtype bf16 --rows 16384 \
        --chunk-rows 256,1024,2048,4096,8192 --compile --json "$RESULTS/head-padding.json"
      ;;
    train-xl)
      checkpoint gpt2-xl
      step bench-train-xl "$PY" -m benchmarks.gpu train --sizes gpt2-xl --no-compile --weights-dir weights \
        --out "$RESULTS/train-xl.json" --markdown "$RESULTS/train-xl.md" --plot "$RESULTS/train-xl.png" \
        "${TRAIN_EXTRA[@]}"
      ;;
    decode)
      checkpoint gpt2
      step bench-decode "$PY" -m benchmarks.gpu decode --sizes gpt2 --weights-dir weights --out "$RESULTS/decode.json" \
        --markdown "$RESULTS/decode.md" --plot "$RESULTS/decode.png" "${DECODE_EXTRA[@]}"
      ;;
    decode-xl)
      checkpoint gpt2-xl
      step bench-decode-xl "$PY" -m benchmarks.gpu decode --sizes gpt2-xl --weights-dir weights --batches 8,32 \
        --out "$RESULTS/decode-xl.json" --markdown "$RESULTS/decode-xl.md" --plot "$RESULTS/decode-xl.png" \
        "${DECODE_EXTRA[@]}"
      ;;
    decode-long)
      checkpoint gpt2
      step bench-decode-long "$PY" -m benchmarks.gpu decode --sizes gpt2 --dtypes bfloat16 --new-tokens 1000 \
        --batches= --no-compile --no-hf-compile --rounds 2 --weights-dir weights --out "$RESULTS/decode-long.json" \
        --markdown "$RESULTS/decode-long.md" --plot "$RESULTS/decode-long.png"
      ;;
    profile)
      checkpoint gpt2
      step bench-profile "$PY" -m benchmarks.gpu_profile --sizes gpt2 --weights-dir weights \
        --out "$RESULTS/profile.json" --markdown "$RESULTS/profile.md"
      ;;
    smoke)
      checkpoint gpt2
      step smoke-parity "${G[@]}" parity weights/gpt2-random --device cpu --ids "464 2444 4721" \
        --json "$RESULTS/smoke-parity.json"
      step smoke-train "$PY" -m benchmarks.gpu train --device cpu --sizes tiny --batch 2 --block 64 --warmup 1 \
        --steps 2 --compile-backend aot_eager --out "$RESULTS/smoke-train.json"
      step smoke-head-padding "$PY" -m benchmarks.head_padding --device cpu --rows 8 --width 16 --vocab 97 \
        --rounds 1 --chunk-rows 3,8 --json "$RESULTS/smoke-head-padding.json"
      step smoke-decode "$PY" -m benchmarks.gpu decode --device cpu --sizes tiny --new-tokens 8 --batches 2 \
        --rounds 1 --compile-backend eager --out "$RESULTS/smoke-decode.json"
      step smoke-profile "$PY" -m benchmarks.gpu_profile --device cpu --sizes tiny --batch 2 --block 32 --steps 1 \
        --warmup 1 --new-tokens 4 --compile-backend eager --out "$RESULTS/smoke-profile.json"
      eval_check cpu 2000 float32
      ;;
  esac
done
exit $failed
