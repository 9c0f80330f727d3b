#!/usr/bin/env bash
# `train_gpt --device cuda` on a machine without a usable GPU (or on a build without CUDA) must stop at once
# with exit code 2 and a message naming the flag and the reason, before loading data or building a model.
# On a machine with a GPU the premise does not hold: the script then skips (exit 77).
#   tests/trainer/train_gpt_no_gpu.sh build/release/examples/gpt/train_gpt
set -uo pipefail
T=$1
out=$(mktemp) err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
"$T" --device cuda --steps 2 --warmup 0 --batch 2 --seq 16 --eval-every 0 --sample-tokens 4 >"$out" 2>"$err"
rc=$?
if [ $rc -eq 0 ]; then echo "SKIP: a CUDA device is present, so --device cuda trained"; exit 77; fi
cat "$err"
[ $rc -eq 2 ] || { echo "FAIL: exit code $rc, expected 2"; exit 1; }
grep -q "^train_gpt: error: --device cuda: no usable CUDA device (.*); train on the CPU with --device cpu$" "$err" \
  || { echo "FAIL: the message does not say that there is no usable CUDA device"; exit 1; }
[ ! -s "$out" ] || { echo "FAIL: work started before the device check:"; cat "$out"; exit 1; }
echo "OK: --device cuda without a GPU fails at once with a clear message"
