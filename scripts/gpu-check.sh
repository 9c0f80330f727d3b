#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (CUDA toolkit present, no network): configure and build the
# CUDA backend for the GPU's architecture (sm_90 by default), run every GPU test (the op database's
# CPU-vs-CUDA tests, the CUDA runtime tests, the tiny-GPT 50-step loss comparison, nn::GPT, the weight
# copies and the trainer's step on CUDA vs the CPU), run `train_gpt --device cuda` end to end against the
# CPU trainer (tests/trainer/train_gpt_cuda.sh; needs CLI11 like every train_gpt build), run the GPU
# training benchmark (nn::BasicGPT<cuda> + BasicAdamW<cuda> + MixedPrecision: gpt2, bf16, B=16, T=1024) and
# PyTorch's eager equivalent when torch with CUDA is importable, the fused attention against the composite and
# PyTorch's SDPA, then while time is left: both frameworks at B=8 with two micro-batches per step, the tiny GPT
# eager, compiled and as CUDA graphs and GPT-2 as CUDA graphs (Note [CUDA graphs of a step]), Nsight
# Compute's per-kernel times of one typegrad step (benchmarks/ncu_summary.py), and torch.compile'd PyTorch in
# modes default and reduce-overhead. It prints one table (tokens/s, ms/step, MFU and peak memory of each run)
# and the ncu summary. Its last line is `ratio typegrad/pytorch_eager X.XX` (tokens/s at BENCH_ARGS).
# Budget: 8 minutes (TG_GPU_BUDGET seconds) in all. Every stage runs under `timeout` with a limit that
# leaves the later stages their minimum, so the script cannot run past the budget: a stage that runs out
# of time is reported as "timed out" in the table instead of stopping the script (the GPU tests, the trainer
# and the typegrad benchmark then fail the check; the other runs are reported only).
# A missing piece (no driver, no GPU, no nvcc, a failed configure or build) stops it early with a message
# naming that piece.
# Build dependencies (Eigen, nlohmann_json, CLI11, GoogleTest) come from the system, or from `.gpu-deps/`
# when it exists (scripts/gpu-deps.sh packs them on a Debian machine, for a GPU machine with no network).
# TG_GPU_PREBUILT=DIR skips configure and build and runs the binaries of a CUDA build made elsewhere
# (DIR/tests/test_cuda, DIR/tests/test_ops, DIR/tests/bench_cuda_gpt, DIR/examples/gpt/train_gpt), for a
# GPU machine without a compiler or with too little time to build.
#   bash scripts/gpu-check.sh                 # from the repository root
#   TG_GPU_ARCH=80 BENCH_ARGS="--batch 8" bash scripts/gpu-check.sh
#   TG_GPU_PREBUILT=build/cuda bash scripts/gpu-check.sh
#   PEAK_TFLOPS=756 bash scripts/gpu-check.sh   # the MFU against another peak than the card's name gives
set -uo pipefail

cd "$(dirname "$0")/.." || exit 1
START=$(date +%s)
BUDGET=${TG_GPU_BUDGET:-480}
ARCH=${TG_GPU_ARCH:-90}
BUILD=${TG_GPU_BUILD:-build/gpu}
JOBS=${TG_GPU_JOBS:-$(nproc)}
BENCH_ARGS=${BENCH_ARGS:-"--model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10 --warmup 2"}
ACCUM_ARGS=${ACCUM_ARGS:-"--model gpt2 --precision bf16 --batch 8 --seq 1024 --grad-accum 2 --steps 10 --warmup 2"}
LOG=$BUILD/gpu-check-logs
PREBUILT=${TG_GPU_PREBUILT:-}
BIN=${PREBUILT:-$BUILD}  # where the binaries are
die() {
  echo "gpu-check: FAILED: $*" >&2
  exit 1
}
elapsed() { echo $(($(date +%s) - START)); }
step() { echo "== [$(elapsed)s] $*"; }

# ---- time limits -------------------------------------------------------------------------------------------
# Each stage's limit is its cap, or less so that the stages after it keep their minimum (RESERVE seconds)
# and `timeout -k` has its grace period (KILL_GRACE) inside the budget. The minimums after each stage:
TESTS_MIN=60 TRAINER_MIN=45 BENCH_MIN=45 TORCH_MIN=45 KILL_GRACE=5
# stage_limit CAP RESERVE: the seconds a stage may run now.
stage_limit() {
  local t=$((BUDGET - $(elapsed) - $2 - KILL_GRACE))
  [ "$t" -gt "$1" ] && t=$1
  echo "$t"
}
# limited LIMIT LOGFILE CMD...: CMD under `timeout` (its whole process group; SIGKILL after the grace
# period), output into LOGFILE. Returns CMD's status; 124 or 137 when it ran out of time, 125 when there
# was no time left to start it.
limited() {
  local limit=$1 log=$2
  shift 2
  if [ "$limit" -lt 5 ]; then
    echo "gpu-check: not started: no time left in the ${BUDGET} s budget" >"$log"
    return 125
  fi
  timeout -k "$KILL_GRACE" "$limit" "$@" >"$log" 2>&1
}
timed_out() { [ "$1" = 124 ] || [ "$1" = 137 ] || [ "$1" = 125 ]; }
# outcome RC LIMIT: a word for the table.
outcome() {
  case "$1" in
    0) echo "passed" ;;
    124 | 137) echo "TIMED OUT after $2 s" ;;
    125) echo "NOT RUN (no time left)" ;;
    77) echo "SKIPPED (rc 77: it saw no usable GPU)" ;;
    *) echo "FAILED (rc $1)" ;;
  esac
}

# ---- what must be there ------------------------------------------------------------------------------
command -v timeout >/dev/null || die "timeout (coreutils) not found"
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine (this check needs a GPU)"
GPU=$(timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1) ||
  die "nvidia-smi cannot query the GPU (or took over 30 s): $GPU"
[ -n "$GPU" ] || die "nvidia-smi lists no GPU"
# The MFU's peak: the dense bf16 tensor-core rate of the card nvidia-smi names, from NVIDIA's datasheets (H100 and
# H200 SXM 989 TFLOP/s, their NVL forms 835, H100 PCIe 756); PEAK_TFLOPS=N overrides it. Both benchmarks get it.
case "$GPU" in
  *PCIe*) PEAK_DEFAULT=756 ;;
  *NVL*) PEAK_DEFAULT=835 ;;
  *) PEAK_DEFAULT=989 ;;
esac
PEAK_TFLOPS=${PEAK_TFLOPS:-$PEAK_DEFAULT}
mkdir -p "$LOG"
rm -f "$LOG"/*  # a rerun on a warm machine: no table or summary of the run before
# whether PyTorch with CUDA is importable, asked in the background while configure, build and tests run
timeout 30 python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1 &
TORCH_PID=$!
TRAINER_NOTE=""
NCCL_NOTE=""
if [ -n "$PREBUILT" ]; then
  for b in tests/test_cuda tests/test_ops tests/bench_cuda_gpt; do
    [ -x "$BIN/$b" ] || die "TG_GPU_PREBUILT=$PREBUILT has no $b"
  done
  [ -x "$BIN/examples/gpt/train_gpt" ] || TRAINER_NOTE="not run: $PREBUILT has no examples/gpt/train_gpt"
  step "GPU: $GPU; prebuilt binaries from $PREBUILT; budget ${BUDGET} s"
else
  NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  [ -x "$NVCC" ] || die "nvcc not found (looked on PATH and at /usr/local/cuda/bin/nvcc; set CUDACXX)"
  command -v cmake >/dev/null || die "cmake not found"
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  if [ -d .gpu-deps ]; then  # packed by scripts/gpu-deps.sh
    export CMAKE_PREFIX_PATH="$PWD/.gpu-deps${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  fi
  step "GPU: $GPU; nvcc: $("$NVCC" --version | tail -1); $(cmake --version | head -1); budget ${BUDGET} s"

  # ---- configure + build (tests, the trainer and the GPU benchmark only) ---------------------------------------
  AFTER_BUILD=$((TESTS_MIN + TRAINER_MIN + BENCH_MIN + TORCH_MIN))
  # configure gets what is left above the build's 60 s and the later stages' minimums: at least 10 s
  NEEDED=$((AFTER_BUILD + 60 + KILL_GRACE + 10))
  [ "$BUDGET" -ge "$NEEDED" ] ||
    die "TG_GPU_BUDGET=$BUDGET s is under the $NEEDED s that configure, build and the later stages need at least"
  step "configure ($BUILD, sm_$ARCH)"
  configure() {  # examples ON|OFF, the log
    limited "$(stage_limit 90 $((AFTER_BUILD + 60)))" "$2" \
      cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DTG_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
      -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DTG_BUILD_BENCHMARKS=OFF -DTG_BUILD_EXAMPLES="$1" -DTG_BUILD_TESTS=ON
  }
  configure ON "$LOG/configure.log"
  RC=$?
  if [ "$RC" != 0 ]; then  # train_gpt needs CLI11; without it, the rest still runs
    timed_out "$RC" && die "cmake configure ran out of time ($LOG/configure.log)"
    mv "$LOG/configure.log" "$LOG/configure-examples.log"
    if grep -q CLI11 "$LOG/configure-examples.log" && configure OFF "$LOG/configure.log"; then
      TRAINER_NOTE="not built: CLI11 missing ($LOG/configure-examples.log)"
    else
      grep -E "Could not find|not found|Error" "$LOG/configure-examples.log" "$LOG/configure.log" 2>/dev/null | head -5 >&2
      die "cmake configure failed (a missing package is named above; full logs: $LOG/configure-examples.log, $LOG/configure.log)"
    fi
  fi
  # NCCL is optional at configure time: say so up front when it is missing (CudaNccl.* and the trainer's
  # data-parallel part then fail with "no NCCL")
  grep -q "NCCL communicator OFF" "$LOG/configure.log" && NCCL_NOTE="NCCL not found next to the toolkit: the build has no NCCL communicator"
  TARGETS=(test_cuda test_ops bench_cuda_gpt bench_cuda_attention)
  [ -z "$TRAINER_NOTE" ] && TARGETS+=(train_gpt)
  BUILD_LIMIT=$(stage_limit 300 "$AFTER_BUILD")
  step "build ${TARGETS[*]} (-j$JOBS, at most ${BUILD_LIMIT} s)"
  limited "$BUILD_LIMIT" "$LOG/build.log" cmake --build "$BUILD" --target "${TARGETS[@]}" -j"$JOBS"
  RC=$?
  if [ "$RC" != 0 ]; then
    timed_out "$RC" && die "the build ran out of time after ${BUILD_LIMIT} s (nothing to test; $LOG/build.log)"
    grep -E "error|Error" "$LOG/build.log" | head -10 >&2
    die "build failed (full log: $LOG/build.log)"
  fi
fi  # TG_GPU_PREBUILT

# ---- GPU tests -------------------------------------------------------------------------------------------------
# Counted from gtest's per-test result lines ("[       OK ] Suite.Name (12 ms)", "[  FAILED  ] ... (3 ms)",
# "[  SKIPPED ] ... (0 ms)"), which are printed as each test ends, so the counts are right when the run is
# cut short too (a timeout, a crash); the closing summary lists failures again without a time and is not
# counted. Tests that started but never finished count as failed; tests never started are "not run". Each
# suite runs in a process of its own (scripts/gtest-by-suite.sh, TG_GPU_TEST_JOBS at a time): a kernel's
# illegal address is sticky for its process, and would fail every later test of a single run; the totals
# are summed over the processes.
# count_results LOG: "passed failed skipped not_run".
count_results() {
  local log=$1 total ok failed skipped started
  total=$(grep -Eo '^\[==========\] Running [0-9]+ test' "$log" | grep -Eo '[0-9]+' | awk '{ s += $1 } END { print s + 0 }')
  ok=$(grep -Ec '^\[ +OK \] .* \([0-9]+ ms\)$' "$log")
  failed=$(grep -Ec '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log")
  skipped=$(grep -Ec '^\[  SKIPPED \] .* \([0-9]+ ms\)$' "$log")
  started=$(grep -Ec '^\[ RUN      \] ' "$log")
  local unfinished=$((started - ok - failed - skipped))
  [ "$unfinished" -gt 0 ] && failed=$((failed + unfinished))
  local not_run=$((${total:-0} - started))
  [ "$not_run" -lt 0 ] && not_run=0
  echo "$ok $failed $skipped $not_run"
}
TESTS_LIMIT=$(stage_limit 150 $((TRAINER_MIN + BENCH_MIN + TORCH_MIN)))
step "GPU tests: test_cuda and test_ops '*cuda*' side by side, a process per suite (at most ${TESTS_LIMIT} s)"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
TEST_JOBS=${TG_GPU_TEST_JOBS:-3}
TEST_THREADS=$(($(nproc) / (2 * TEST_JOBS)))  # the CPU references of 2 x TEST_JOBS processes share the cores
[ "$TEST_THREADS" -ge 1 ] || TEST_THREADS=1
OMP_NUM_THREADS=$TEST_THREADS limited "$TESTS_LIMIT" "$LOG/test_cuda.log" \
  bash scripts/gtest-by-suite.sh "$BIN/tests/test_cuda" '*' "$TEST_JOBS" &
PID_CUDA=$!
OMP_NUM_THREADS=$TEST_THREADS limited "$TESTS_LIMIT" "$LOG/test_ops.log" \
  bash scripts/gtest-by-suite.sh "$BIN/tests/test_ops" '*cuda*' "$TEST_JOBS" &
PID_OPS=$!
wait "$PID_CUDA"
CRC=$?
wait "$PID_OPS"
ORC=$?
read -r CP CF CS CN <<<"$(count_results "$LOG/test_cuda.log")"
read -r OP OF OS ON <<<"$(count_results "$LOG/test_ops.log")"
tests_row() {  # passed failed skipped not_run rc
  local s="$1 passed, $2 failed, $3 skipped"
  [ "$4" != 0 ] && s="$s, $4 not run"
  timed_out "$5" && s="$s ($(outcome "$5" "$TESTS_LIMIT"))"
  ! timed_out "$5" && [ "$5" != 0 ] && [ "$2" = 0 ] && s="$s (exited with rc $5)"
  echo "$s"
}
TESTS_OK=1
{ [ "$CRC" = 0 ] && [ "$ORC" = 0 ] && [ "$CF" = 0 ] && [ "$OF" = 0 ]; } || TESTS_OK=0
# With a GPU present nothing may skip: a skip here means the tests did not see the device. Nor may a run
# be empty (a filter that matched nothing, a binary that died before its first test).
{ [ "$CS" = 0 ] && [ "$OS" = 0 ] && [ "$CP" -gt 0 ] && [ "$OP" -gt 0 ]; } || TESTS_OK=0
grep -E '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$LOG/test_cuda.log" "$LOG/test_ops.log" | head -10

# train_gpt --device cuda against the CPU trainer (fp32, bf16, checkpoints across devices, --checkpoint blocks).
TRAINER="$TRAINER_NOTE"
if [ -z "$TRAINER_NOTE" ]; then
  TRAINER_LIMIT=$(stage_limit 120 $((BENCH_MIN + TORCH_MIN)))
  step "train_gpt --device cuda (tests/trainer/train_gpt_cuda.sh, at most ${TRAINER_LIMIT} s)"
  limited "$TRAINER_LIMIT" "$LOG/trainer_cuda.log" bash tests/trainer/train_gpt_cuda.sh "$BIN/examples/gpt/train_gpt" "$BUILD/trainer-cuda"
  TRC=$?
  tail -5 "$LOG/trainer_cuda.log"
  SPEED=$(grep -h "speed" "$BUILD/trainer-cuda/gpu_bf16.out" 2>/dev/null | sed 's/^ *speed *//')
  if [ "$TRC" = 0 ]; then
    TRAINER="passed (tiny, bf16: ${SPEED:-?})"
  else
    TRAINER="$(outcome "$TRC" "$TRAINER_LIMIT") ($LOG/trainer_cuda.log)"
    TESTS_OK=0
  fi
fi  # TG_GPU_PREBUILT

# ---- benchmarks ----------------------------------------------------------------------------------------------
# Each run prints a RESULT line (tokens_per_s, ms_per_step, mfu, peak_gib); run_bench LABEL LOGNAME CAP
# RESERVE CMD... runs one under its limit and adds a row to the table (a failed or cut-short run has no
# number to trust: its row says why). The ratio on the last line is typegrad over PyTorch eager at BENCH_ARGS.
field() { grep -Eo "$1=[0-9.]+" "$2" | head -1 | cut -d= -f2; }
ROWS=()
LAST_RC=0
run_bench() {
  local label=$1 log=$LOG/$2.log cap=$3 reserve=$4
  shift 4
  local limit
  limit=$(stage_limit "$cap" "$reserve")
  step "$label (at most ${limit} s)"
  limited "$limit" "$log" "$@"
  LAST_RC=$?
  cat "$log"
  if [ "$LAST_RC" = 0 ] && [ -n "$(field tokens_per_s "$log")" ]; then
    local mfu peak
    mfu=$(awk -v m="$(field mfu "$log")" 'BEGIN { printf "%.1f%%", 100 * m }')
    peak=$(field peak_gib "$log")
    ROWS+=("| $label | $(field tokens_per_s "$log") | $(field ms_per_step "$log") | $mfu | ${peak:--} GiB |")
  else
    ROWS+=("| $label | $(outcome "$LAST_RC" "$limit") ($log) | | | |")
  fi
}
TORCH_OK=0
wait "$TORCH_PID" && TORCH_OK=1  # asked while the build ran

# 1. the ratio's pair: typegrad and PyTorch eager at BENCH_ARGS
# shellcheck disable=SC2086
run_bench "typegrad, $BENCH_ARGS" bench_typegrad 90 "$TORCH_MIN" "$BIN/tests/bench_cuda_gpt" $BENCH_ARGS --peak-tflops "$PEAK_TFLOPS"
BRC=$LAST_RC
TG_TPS=$([ "$BRC" = 0 ] && field tokens_per_s "$LOG/bench_typegrad.log")
PT_TPS=""
if [ "$TORCH_OK" = 1 ]; then
  # shellcheck disable=SC2086
  run_bench "PyTorch eager, $BENCH_ARGS" bench_torch 90 0 python3 benchmarks/torch_gpt_cuda.py $BENCH_ARGS --peak-tflops "$PEAK_TFLOPS"
  [ "$LAST_RC" = 0 ] && PT_TPS=$(field tokens_per_s "$LOG/bench_torch.log")
else
  ROWS+=("| PyTorch eager | PyTorch with CUDA is not importable here: no comparison | | | |")
fi

# 2. the fused attention alone: typegrad fused (both kernel sets) vs composite, PyTorch SDPA (same shape)
ATTN_ARGS="--precision bf16 --batch 16 --heads 12 --seq 1024 --head-size 64"
ATTN="-" ATTN_TORCH="-"
ATTN_LIMIT=$(stage_limit 45 0)
if [ -x "$BIN/tests/bench_cuda_attention" ] && [ "$ATTN_LIMIT" -ge 10 ]; then
  step "attention benchmark: $ATTN_ARGS (at most ${ATTN_LIMIT} s)"
  # shellcheck disable=SC2086
  if limited "$ATTN_LIMIT" "$LOG/bench_attention.log" "$BIN/tests/bench_cuda_attention" $ATTN_ARGS; then
    ATTN="fused $(field fused_ms "$LOG/bench_attention.log") ms (tiles $(field tiles_ms "$LOG/bench_attention.log"), registers $(field registers_ms "$LOG/bench_attention.log")), composite $(field composite_ms "$LOG/bench_attention.log") ms"
  else
    ATTN="failed ($LOG/bench_attention.log)"
  fi
  cat "$LOG/bench_attention.log"
  ATTN_LIMIT=$(stage_limit 45 0)
  if [ "$TORCH_OK" = 1 ] && [ "$ATTN_LIMIT" -ge 10 ]; then
    # shellcheck disable=SC2086
    if limited "$ATTN_LIMIT" "$LOG/bench_sdpa.log" python3 benchmarks/torch_sdpa_cuda.py $ATTN_ARGS; then
      ATTN_TORCH="$(field torch_ms "$LOG/bench_sdpa.log") ms"
    else
      ATTN_TORCH="failed ($LOG/bench_sdpa.log)"
    fi
    cat "$LOG/bench_sdpa.log"
  fi
fi

# 3. half the batch with two micro-batches per step (the same tokens per step), both frameworks, while time is left
optional_bench() {  # LABEL LOGNAME CMD...: run_bench with a 90 s cap when at least 30 s are left, else a row saying so
  if [ "$(stage_limit 90 0)" -ge 30 ]; then
    run_bench "$@"
  else
    ROWS+=("| $1 | not run (no time left in the ${BUDGET} s budget) | | | |")
  fi
}
# shellcheck disable=SC2086
optional_bench "typegrad, $ACCUM_ARGS" bench_typegrad_accum 90 0 "$BIN/tests/bench_cuda_gpt" $ACCUM_ARGS --peak-tflops "$PEAK_TFLOPS"
if [ "$TORCH_OK" = 1 ]; then
  # shellcheck disable=SC2086
  optional_bench "PyTorch eager, $ACCUM_ARGS" bench_torch_accum 90 0 python3 benchmarks/torch_gpt_cuda.py $ACCUM_ARGS --peak-tflops "$PEAK_TFLOPS"
fi

# 3b. the compiled step and CUDA graphs (Note [CUDA graphs of a step]): the tiny GPT (launch-bound) eager, compiled
# and with its replays as graphs, then GPT-2 at BENCH_ARGS as graphs, while time is left
TINY_ARGS="--model tiny --precision fp32 --batch 4 --seq 64 --steps 50 --warmup 5"
for v in "" "--compile" "--compile --cuda-graphs" "--compile --cuda-graphs --graph-chunk 0"; do
  # shellcheck disable=SC2086
  optional_bench "typegrad tiny ${v:-eager}, $TINY_ARGS" "bench_tiny${v// /_}" 90 0 "$BIN/tests/bench_cuda_gpt" $TINY_ARGS $v --peak-tflops "$PEAK_TFLOPS"
done
# shellcheck disable=SC2086
optional_bench "typegrad --compile --cuda-graphs, $BENCH_ARGS" bench_typegrad_graphs 90 0 "$BIN/tests/bench_cuda_gpt" $BENCH_ARGS --compile --cuda-graphs --peak-tflops "$PEAK_TFLOPS"

# 4. where one typegrad step's time goes: Nsight Compute, each kernel of the timed step summed by name
NCU_SUMMARY="not run"
NCU=$(command -v ncu)
for c in /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu; do
  [ -z "$NCU" ] && [ -x "$c" ] && NCU=$c
done
NCU_ARGS="--model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 1 --warmup 1"
NCU_LIMIT=$(stage_limit 120 0)
if [ -z "$NCU" ]; then
  NCU_SUMMARY="not run: ncu (Nsight Compute) not found"
elif [ "$NCU_LIMIT" -lt 40 ]; then
  NCU_SUMMARY="not run: no time left in the ${BUDGET} s budget"
else
  step "ncu per-kernel profile of one step: $NCU_ARGS (at most ${NCU_LIMIT} s)"
  # shellcheck disable=SC2086
  if limited "$NCU_LIMIT" "$LOG/ncu.csv" "$NCU" --profile-from-start off --metrics gpu__time_duration.sum --csv \
    "$BIN/tests/bench_cuda_gpt" $NCU_ARGS &&
    python3 benchmarks/ncu_summary.py "$LOG/ncu.csv" --top 15 >"$LOG/ncu_summary.md" 2>&1; then
    NCU_SUMMARY=$(head -1 "$LOG/ncu_summary.md")
  else
    NCU_SUMMARY="failed or cut short ($LOG/ncu.csv, $LOG/ncu_summary.md)"
    tail -5 "$LOG/ncu.csv"
  fi
fi

# 5. torch.compile'd PyTorch (modes default and reduce-overhead) at BENCH_ARGS, while time is left
for mode in default reduce-overhead; do
  label="PyTorch torch.compile mode $mode, $BENCH_ARGS"
  if [ "$TORCH_OK" = 1 ] && [ "$(stage_limit 120 0)" -ge 30 ]; then
    # shellcheck disable=SC2086
    run_bench "$label" "bench_torch_compile_$mode" 120 0 python3 benchmarks/torch_gpt_cuda.py $BENCH_ARGS --compile --compile-mode "$mode" --peak-tflops "$PEAK_TFLOPS"
  else
    ROWS+=("| $label | not run (no time left, or no PyTorch) | | | |")
  fi
done

# ---- table ----------------------------------------------------------------------------------------------------
RATIO="-"
[ -n "$TG_TPS" ] && [ -n "$PT_TPS" ] && RATIO=$(awk -v a="$TG_TPS" -v b="$PT_TPS" 'BEGIN { printf "%.2f", a / b }')
echo
echo "| check or run | result, or tokens/s | ms/step | MFU ($PEAK_TFLOPS TFLOP/s) | peak memory |"
echo "|---|---|---|---|---|"
echo "| GPU | $GPU | | | |"
[ -n "$NCCL_NOTE" ] && echo "| NCCL | $NCCL_NOTE | | | |"
echo "| test_cuda (runtime, tiny GPT 50 steps, nn::GPT, weight copies, trainer step, NCCL world of 1) | $(tests_row "$CP" "$CF" "$CS" "$CN" "$CRC") | | | |"
echo "| test_ops CPU-vs-CUDA (every op, fp32/bf16/fp16, fwd+grad) | $(tests_row "$OP" "$OF" "$OS" "$ON" "$ORC") | | | |"
echo "| train_gpt --device cuda vs --device cpu | $TRAINER | | | |"
for row in "${ROWS[@]}"; do echo "$row"; done
echo "| typegrad / PyTorch eager, tokens/s at $BENCH_ARGS | $RATIO | | | |"
echo "| attention fwd+bwd, typegrad ($ATTN_ARGS) | $ATTN | | | |"
echo "| attention fwd+bwd, PyTorch SDPA | $ATTN_TORCH | | | |"
echo "| ncu, one typegrad step ($NCU_ARGS) | $NCU_SUMMARY | | | |"
echo "| wall time | $(elapsed) s (budget $BUDGET s) | | | |"
if [ -s "$LOG/ncu_summary.md" ] && grep -q '^| ' "$LOG/ncu_summary.md"; then
  echo
  cat "$LOG/ncu_summary.md"
fi
echo "logs: $LOG"

# The verdict, then the ratio line last whatever the verdict (a failed check still measured the ratio it prints)
VERDICT=""
if [ "$TESTS_OK" != 1 ]; then
  VERDICT="GPU tests failed, timed out or skipped (test_cuda rc $CRC, test_ops rc $ORC, train_gpt: $TRAINER; logs in $LOG)"
elif [ "$BRC" != 0 ]; then
  VERDICT="the typegrad GPU benchmark did not pass (rc $BRC; $LOG/bench_typegrad.log)"
elif [ "$(elapsed)" -gt "$BUDGET" ]; then
  VERDICT="took $(elapsed) s, over the ${BUDGET} s budget"
fi
if [ -n "$VERDICT" ]; then echo "gpu-check: FAILED: $VERDICT"; else echo "gpu-check: OK"; fi
echo "ratio typegrad/pytorch_eager $RATIO"
[ -z "$VERDICT" ]
