#!/usr/bin/env bash
# Compiled against eager training steps on this machine (docs/performance.md, "Compiled steps"): bench_train_step
# with and without --compile, alternated run by run (A B A B ...), for GPT-2 124M at B=4 T=64 in fp32 and bf16
# and the tiny GPT at B=4 T=64 and B=1 T=16 (overhead-bound), 2 threads. Prints one table row per case: the
# median of each run's median step time, the ratio compiled / eager, and both peaks.
#   bash benchmarks/compile.sh build/release/benchmarks/bench_train_step [rounds]
set -euo pipefail
B=$(realpath "$1")
ROUNDS=${2:-3}
CASES=("gpt2 4 64 fp32 6 2" "gpt2 4 64 bf16 6 2" "tiny 4 64 fp32 40 5" "tiny 1 16 fp32 200 20")
echo "| model | B x T | precision | eager ms/step | compiled ms/step | compiled / eager | eager peak MiB | compiled peak MiB |"
echo "|---|---|---|---|---|---|---|---|"
for c in "${CASES[@]}"; do
  set -- $c
  args=(--model "$1" --batch "$2" --seq "$3" --precision "$4" --steps "$5" --warmup "$6" --threads 2)
  eager=() compiled=() epeak=0 cpeak=0
  for _ in $(seq "$ROUNDS"); do
    e=$("$B" "${args[@]}" | grep '^{')
    k=$("$B" "${args[@]}" --compile | grep '^{')
    eager+=("$(echo "$e" | sed 's/.*"median_ms":\([0-9.]*\).*/\1/')")
    compiled+=("$(echo "$k" | sed 's/.*"median_ms":\([0-9.]*\).*/\1/')")
    epeak=$(echo "$e" | sed 's/.*"peak_bytes":\([0-9]*\).*/\1/')
    cpeak=$(echo "$k" | sed 's/.*"peak_bytes":\([0-9]*\).*/\1/')
  done
  /usr/bin/python3 - "$1" "$2x$3" "$4" "$epeak" "$cpeak" "${eager[*]}" "${compiled[*]}" <<'EOF'
import statistics, sys
model, shape, prec, ep, cp = sys.argv[1:6]
e = statistics.median(map(float, sys.argv[6].split()))
c = statistics.median(map(float, sys.argv[7].split()))
print(f"| {model} | {shape} | {prec} | {e:.2f} | {c:.2f} | {c / e:.3f} | {int(ep) / 2**20:.1f} | {int(cp) / 2**20:.1f} |")
EOF
done
