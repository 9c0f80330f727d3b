#!/usr/bin/env bash
# scripts/gpu-check.sh's own logic, without a GPU: stand-ins for nvidia-smi, ncu, python3's PyTorch scripts and
# the prebuilt binaries (TG_GPU_PREBUILT) print what the real ones print, and the check reads the table, the
# ncu summary and the last line. A second run makes one GPU test fail and needs the script to fail, its last line
# still the ratio.
#   bash tests/cuda/gpu_check_dry_run.sh
set -euo pipefail
SRC=$(cd "$(dirname "$0")/../.." && pwd)
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/bin" "$W/pre/tests"
REAL_PY=$(command -v python3)
fake() {  # fake PATH BODY: an executable script
  printf '#!/bin/bash\n%s\n' "$2" >"$1"
  chmod +x "$1"
}
fake "$W/bin/nvidia-smi" 'echo "Stand-in GPU, 81559 MiB, 580.0"'
cat >"$W/ncu.csv" <<'CSV'
==PROF== Connected to process 1 (bench_cuda_gpt)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","bench_cuda_gpt","h","void tg::backend::cuda::(anonymous namespace)::layernorm_fwd<__nv_bfloat16>(const T1 *, long)","1","7","(256, 1, 1)","(16, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","250.5"
"1","1","bench_cuda_gpt","h","void tg::backend::cuda::(anonymous namespace)::layernorm_fwd<__nv_bfloat16>(const T1 *, long)","1","7","(256, 1, 1)","(16, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","249.5"
"2","1","bench_cuda_gpt","h","nvjet_sm90_tst_128x256_bias_TNT","1","7","(384, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,500,000"
CSV
fake "$W/bin/ncu" "[ \"\$1\" = --profile-from-start ] || exit 9; cat '$W/ncu.csv'"
fake "$W/bin/python3" "case \"\$1\" in
  -c) exit 0 ;;
  benchmarks/torch_gpt_cuda.py) echo \"args \$*\"; echo 'RESULT tokens_per_s=200000 ms_per_step=80.00 mfu=0.1900 peak_gib=16.05 loss=7.0' ;;
  benchmarks/torch_sdpa_cuda.py) echo 'RESULT torch_ms=1.9' ;;
  *) exec '$REAL_PY' \"\$@\" ;;
esac"
# A test binary of two suites (A: b, c; B: d) as gpu-check runs it: listed, then one process per suite.
# FAIL names a test that fails, CRASH one whose process dies (as a sticky CUDA fault would end it).
gtest() {
  printf 'case "$*" in *--gtest_list_tests*) printf "A.\\n  b\\n  c\\nB.\\n  d\\n"; exit 0 ;; esac
sel=$(echo "${1#--gtest_filter=}" | tr ":" " ")
echo "[==========] Running $(echo $sel | wc -w) tests from 1 test suite."
for t in $sel; do
  echo "[ RUN      ] $t"
  [ "$t" = "%s" ] && exit 134
  if [ "$t" = "%s" ]; then echo "[  FAILED  ] $t (1 ms)"; rc=1; else echo "[       OK ] $t (1 ms)"; fi
done
exit ${rc:-0}' "$1" "$2"
}
fake "$W/pre/tests/test_cuda" "$(gtest none none)"
fake "$W/pre/tests/test_ops" "$(gtest none none)"
fake "$W/pre/tests/bench_cuda_gpt" 'echo "args $*"; case "$*" in *grad-accum*) t=140000 ;; *) t=150000 ;; esac
echo "RESULT tokens_per_s=$t ms_per_step=109.23 mfu=0.1300 peak_gib=11.50 loss=7.1"'
fake "$W/pre/tests/bench_cuda_attention" 'echo "RESULT fused_ms=1.5 tiles_ms=1.5 registers_ms=0.9 composite_ms=6.0"'

run() { PATH="$W/bin:$PATH" TG_GPU_PREBUILT="$W/pre" TG_GPU_BUILD="$W/build" bash "$SRC/scripts/gpu-check.sh" >"$W/out" 2>&1; }
fail() {
  cat "$W/out"
  echo "FAILED: $*"
  exit 1
}
run || fail "gpu-check failed with stand-ins that all pass"
has() { grep -qF -- "$1" "$W/out" || fail "the output lacks: $1"; }
has "| typegrad, --model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10 --warmup 2 | 150000 | 109.23 | 13.0% | 11.50 GiB |"
has "| PyTorch eager, --model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10 --warmup 2 | 200000 | 80.00 | 19.0% | 16.05 GiB |"
has "| typegrad, --model gpt2 --precision bf16 --batch 8 --seq 1024 --grad-accum 2 --steps 10 --warmup 2 | 140000 |"
has "| PyTorch eager, --model gpt2 --precision bf16 --batch 8 --seq 1024 --grad-accum 2 --steps 10 --warmup 2 | 200000 |"
has "| PyTorch torch.compile mode reduce-overhead,"
has "| attention fwd+bwd, typegrad (--precision bf16 --batch 16 --heads 12 --seq 1024 --head-size 64) | fused 1.5 ms (tiles 1.5, registers 0.9), composite 6.0 ms |"
has "| attention fwd+bwd, PyTorch SDPA | 1.9 ms |"
has "ncu: 3 kernel launches, 2 kernels by name, 2.00 ms in all"
has '| `nvjet_sm90_tst_128x256_bias_TNT` | 1 | 1.50 | 75.0% |'
has '| `tg::backend::cuda::{anon}::layernorm_fwd<__nv_bfloat16>` | 2 | 0.50 | 25.0% |'
has "| test_cuda (runtime, tiny GPT 50 steps, nn::GPT, weight copies, trainer step, NCCL world of 1) | 3 passed, 0 failed, 0 skipped |"
[ "$(tail -1 "$W/out")" = "ratio typegrad/pytorch_eager 0.75" ] || fail "the last line is not 'ratio typegrad/pytorch_eager 0.75'"
# the MFU's peak follows the card's name (a name without PCIe or NVL: the SXM parts' 989), and both benchmarks get it
has "| MFU (989 TFLOP/s) |"
grep -q -- "--peak-tflops 989" "$W/build/gpu-check-logs/bench_typegrad.log" || fail "typegrad's benchmark was not given --peak-tflops 989"
grep -q -- "--peak-tflops 989" "$W/build/gpu-check-logs/bench_torch.log" || fail "PyTorch's benchmark was not given --peak-tflops 989"
fake "$W/bin/nvidia-smi" 'echo "NVIDIA H100 PCIe, 81559 MiB, 580.0"'
run || fail "gpu-check failed on an H100 PCIe stand-in"
has "| MFU (756 TFLOP/s) |"
fake "$W/bin/nvidia-smi" 'echo "Stand-in GPU, 81559 MiB, 580.0"'

# a failing GPU test fails the check, and the table says so; a suite whose process dies takes only its own
# tests down (B.d, counted as failed), the other suites' results stand
fake "$W/pre/tests/test_ops" "$(gtest B.d A.c)"
if run; then fail "gpu-check passed with a failing GPU test"; fi
has "| test_ops CPU-vs-CUDA (every op, fp32/bf16/fp16, fwd+grad) | 1 passed, 2 failed, 0 skipped |"
# a process dying in its suite's first test: that test failed, the suite's next one not run, suite B passed
fake "$W/pre/tests/test_ops" "$(gtest A.b none)"
if run; then fail "gpu-check passed with a GPU test process that died"; fi
has "| test_ops CPU-vs-CUDA (every op, fp32/bf16/fp16, fwd+grad) | 1 passed, 1 failed, 0 skipped, 1 not run |"
has "gpu-check: FAILED: GPU tests failed"
[ "$(tail -1 "$W/out")" = "ratio typegrad/pytorch_eager 0.75" ] || fail "a failed check's last line is not the ratio it measured"
echo "gpu-check dry run: table, ncu summary, ratio line and a failing test's verdict as expected"
