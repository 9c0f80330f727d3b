#!/usr/bin/env bash
# bench_cuda_gpt's clear failures: a bad flag exits 2 with the usage (on every machine), and on a machine
# without a usable GPU (or a build without CUDA) a run exits 1 with "no CUDA device" before building a model.
# On a machine with a GPU the second premise does not hold: the tiny run trains and the script skips (77).
#   tests/cuda/bench_cuda_gpt_no_gpu.sh build/release/tests/bench_cuda_gpt
set -uo pipefail
B=$1
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
fail() { echo "FAIL: $*"; echo "--- stdout"; cat "$out"; echo "--- stderr"; cat "$err"; exit 1; }

for bad in "--precision fp8" "--model huge" "--batch 0" "--grad-accum 0" "--steps x" "--seq 4096" "--peak-tflops -1" "--frobnicate 1" \
  "--cuda-graphs" "--compile --cuda-graphs --graph-chunk x"; do
  # shellcheck disable=SC2086
  "$B" $bad >"$out" 2>"$err"
  rc=$?
  [ $rc -eq 2 ] || fail "'$bad': exit code $rc, expected 2"
  grep -q "^usage: bench_cuda_gpt" "$err" || fail "'$bad': no usage line"
  [ ! -s "$out" ] || fail "'$bad': printed results"
done
grep -q "unknown precision 'fp8' (expected bf16, fp16 or fp32)" <("$B" --precision fp8 2>&1) || fail "the precision error does not name the choices"

"$B" --model tiny --precision bf16 --batch 1 --seq 16 --steps 1 --warmup 0 >"$out" 2>"$err"
rc=$?
if [ $rc -eq 0 ]; then
  grep -q "^RESULT tokens_per_s=[0-9]* ms_per_step=[0-9.]* mfu=[0-9.]* peak_gib=[0-9.]* loss=[0-9.]*$" "$out" || fail "no RESULT line"
  echo "SKIP: a CUDA device is present, so the benchmark ran"
  exit 77
fi
[ $rc -eq 1 ] || fail "exit code $rc without a GPU, expected 1"
grep -q "^bench_cuda_gpt: no CUDA device (.*); this benchmark needs an NVIDIA GPU$" "$err" || fail "the message does not say that there is no CUDA device"
[ ! -s "$out" ] || fail "work started before the device check"
echo "OK: bad flags exit 2 with the usage; without a GPU the benchmark fails at once with a clear message"
