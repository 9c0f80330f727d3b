#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU (CUDA toolkit present, no network): configure and build the
# CUDA backend for the GPU's architecture (sm_90 by default), run every GPU test (the op database's
# CPU-vs-CUDA tests, the CUDA runtime tests, the tiny-GPT 50-step loss comparison, nn::GPT and the trainer's
# step on CUDA vs the CPU), run `train_gpt --device cuda` end to end against the CPU trainer
# (tests/trainer/train_gpt_cuda.sh; needs CLI11 like every train_gpt build), run the GPU training benchmark (gpt2, bf16, B=16, T=1024) and PyTorch's equivalent when torch with CUDA is importable, and
# print a short table. Any missing piece stops it with a message naming that piece. Budget: 8 minutes.
#   bash scripts/gpu-check.sh                 # from the repository root
#   TG_GPU_ARCH=80 BENCH_ARGS="--batch 8" bash scripts/gpu-check.sh
set -uo pipefail

cd "$(dirname "$0")/.."
START=$(date +%s)
ARCH=${TG_GPU_ARCH:-90}
BUILD=${TG_GPU_BUILD:-build/gpu}
BENCH_ARGS=${BENCH_ARGS:-"--model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10 --warmup 2"}
LOG=$BUILD/gpu-check-logs
die() {
  echo "gpu-check: FAILED: $*" >&2
  exit 1
}
elapsed() { echo $(($(date +%s) - START)); }
step() { echo "== [$(elapsed)s] $*"; }

# ---- what must be there ------------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: no NVIDIA driver on this machine"
GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1) ||
  die "nvidia-smi cannot query the GPU: $GPU"
[ -n "$GPU" ] || die "nvidia-smi lists no GPU"
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || die "nvcc not found (looked on PATH and at /usr/local/cuda/bin/nvcc; set CUDACXX)"
command -v cmake >/dev/null || die "cmake not found"
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
mkdir -p "$LOG"
step "GPU: $GPU; nvcc: $("$NVCC" --version | tail -1)"

# ---- configure + build (tests and the GPU benchmark only) ------------------------------------------------
step "configure ($BUILD, sm_$ARCH)"
configure() {  # examples ON|OFF
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release -DTG_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" \
    -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DTG_BUILD_BENCHMARKS=OFF -DTG_BUILD_EXAMPLES="$1" -DTG_BUILD_TESTS=ON \
    >"$LOG/configure.log" 2>&1
}
TRAINER_NOTE=""
if ! configure ON; then  # train_gpt needs CLI11; without it, the rest still runs
  if grep -q CLI11 "$LOG/configure.log" && configure OFF; then
    TRAINER_NOTE="not built: CLI11 missing ($LOG/configure.log)"
  else
    grep -E "Could not find|not found|Error" "$LOG/configure.log" | head -5 >&2
    die "cmake configure failed (a missing package is named above; full log: $LOG/configure.log)"
  fi
fi
TARGETS=(test_cuda test_ops bench_cuda_gpt)
[ -z "$TRAINER_NOTE" ] && TARGETS+=(train_gpt)
step "build ${TARGETS[*]}"
if ! cmake --build "$BUILD" --target "${TARGETS[@]}" -j"$(nproc)" >"$LOG/build.log" 2>&1; then
  grep -E "error|Error" "$LOG/build.log" | head -10 >&2
  die "build failed (full log: $LOG/build.log)"
fi

# ---- GPU tests -------------------------------------------------------------------------------------------------
# gtest's summary: "[  PASSED  ] N tests.", "[  FAILED  ] N tests", "[  SKIPPED ] N tests".
count() { grep -Eo "^\[  $1 +\] [0-9]+ test" "$2" | grep -Eo "[0-9]+" | tail -1; }
run_tests() {  # name, executable, filter
  local out="$LOG/$1.log"
  timeout 240 "$2" --gtest_filter="$3" --gtest_brief=1 >"$out" 2>&1
  local rc=$?
  local p f s
  p=$(count PASSED "$out"); f=$(count FAILED "$out"); s=$(count SKIPPED "$out")
  echo "${p:-0} ${f:-0} ${s:-0} $rc"
}
step "GPU tests"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
read -r CP CF CS CRC <<<"$(run_tests test_cuda "$BUILD/tests/test_cuda" '*')"
read -r OP OF OS ORC <<<"$(run_tests test_ops "$BUILD/tests/test_ops" '*cuda*')"
TESTS_OK=1
{ [ "$CRC" = 0 ] && [ "$ORC" = 0 ]; } || TESTS_OK=0
# With a GPU present nothing may skip: a skip here means the tests did not see the device.
{ [ "$CS" = 0 ] && [ "$OS" = 0 ]; } || TESTS_OK=0

# train_gpt --device cuda against the CPU trainer (fp32, bf16, checkpoints across devices, --checkpoint blocks).
TRAINER="$TRAINER_NOTE"
if [ -z "$TRAINER_NOTE" ]; then
  step "train_gpt --device cuda (tests/trainer/train_gpt_cuda.sh)"
  timeout 180 bash tests/trainer/train_gpt_cuda.sh "$BUILD/examples/gpt/train_gpt" "$BUILD/trainer-cuda" >"$LOG/trainer_cuda.log" 2>&1
  TRC=$?
  tail -5 "$LOG/trainer_cuda.log"
  SPEED=$(grep -h "speed" "$BUILD/trainer-cuda/gpu_bf16.out" 2>/dev/null | sed 's/^ *speed *//')
  if [ "$TRC" = 0 ]; then TRAINER="passed (tiny, bf16: ${SPEED:-?})"; else TRAINER="FAILED (rc $TRC, $LOG/trainer_cuda.log)"; TESTS_OK=0; fi
fi

# ---- benchmarks ----------------------------------------------------------------------------------------------
field() { grep -Eo "$1=[0-9.]+" "$2" | head -1 | cut -d= -f2; }
step "typegrad GPU benchmark: $BENCH_ARGS"
# shellcheck disable=SC2086
timeout 150 "$BUILD/tests/bench_cuda_gpt" $BENCH_ARGS >"$LOG/bench_typegrad.log" 2>&1
BRC=$?
cat "$LOG/bench_typegrad.log"
TG_TPS=$(field tokens_per_s "$LOG/bench_typegrad.log"); TG_MFU=$(field mfu "$LOG/bench_typegrad.log")

PT_TPS="" PT_MFU="" PT_NOTE=""
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  step "PyTorch benchmark: $BENCH_ARGS"
  # shellcheck disable=SC2086
  timeout 150 python3 benchmarks/torch_gpt_cuda.py $BENCH_ARGS >"$LOG/bench_torch.log" 2>&1
  PRC=$?
  cat "$LOG/bench_torch.log"
  PT_TPS=$(field tokens_per_s "$LOG/bench_torch.log"); PT_MFU=$(field mfu "$LOG/bench_torch.log")
  [ "$PRC" = 0 ] || PT_NOTE="PyTorch run failed (rc $PRC, $LOG/bench_torch.log)"
else
  PT_NOTE="PyTorch with CUDA is not importable here: no comparison"
fi

# ---- table ----------------------------------------------------------------------------------------------------
pct() { [ -n "$1" ] && awk -v m="$1" 'BEGIN { printf "%.1f%%", 100 * m }' || echo "-"; }
RATIO="-"
[ -n "$TG_TPS" ] && [ -n "$PT_TPS" ] && RATIO=$(awk -v a="$TG_TPS" -v b="$PT_TPS" 'BEGIN { printf "%.2f", a / b }')
echo
echo "| check | result |"
echo "|---|---|"
echo "| GPU | $GPU |"
echo "| test_cuda (runtime, tiny GPT 50 steps, nn::GPT + trainer step) | ${CP} passed, ${CF} failed, ${CS} skipped |"
echo "| test_ops CPU-vs-CUDA (every op, fp32/bf16/fp16, fwd+grad) | ${OP} passed, ${OF} failed, ${OS} skipped |"
echo "| train_gpt --device cuda vs --device cpu | $TRAINER |"
echo "| typegrad tokens/s ($BENCH_ARGS) | ${TG_TPS:-failed (rc $BRC)} |"
echo "| typegrad MFU | $(pct "$TG_MFU") |"
echo "| PyTorch tokens/s | ${PT_TPS:-$PT_NOTE} |"
echo "| PyTorch MFU | $(pct "$PT_MFU") |"
echo "| typegrad / PyTorch | $RATIO |"
echo "| wall time | $(elapsed) s (budget 480 s) |"
echo "logs: $LOG"

[ "$TESTS_OK" = 1 ] || die "GPU tests failed or skipped (test_cuda rc $CRC, test_ops rc $ORC, train_gpt: $TRAINER; logs in $LOG)"
[ "$BRC" = 0 ] || die "the typegrad GPU benchmark failed (rc $BRC; $LOG/bench_typegrad.log)"
[ "$(elapsed)" -le 480 ] || die "took $(elapsed) s, over the 8-minute budget"
echo "gpu-check: OK"
