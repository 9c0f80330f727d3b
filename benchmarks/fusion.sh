#!/usr/bin/env bash
# tg::compile's fusion rewrites on a step written with separate ops (docs/performance.md, "Fusion rewrites"):
# bench_fusion eager, compiled with fusion ("fused") and compiled without it ("plain"), alternated run by run, 2
# threads. One table row per precision: the median of each run's median step time, the ratios, and the peaks.
#   bash benchmarks/fusion.sh build/release/benchmarks/bench_fusion [rounds] [extra bench_fusion options]
#   bash benchmarks/fusion.sh build/release/benchmarks/bench_fusion 5 --step block   # the pair rewrites
#   bash benchmarks/fusion.sh build/release/benchmarks/bench_fusion 5 --step attention   # attention_composite's middle
set -euo pipefail
B=$(realpath "$1")
ROUNDS=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
echo "| precision | eager ms/step | plain compiled ms/step | fused ms/step | fused / eager | eager peak MiB | fused peak MiB | chains | pairs |"
echo "|---|---|---|---|---|---|---|---|---|"
for prec in fp32 bf16; do
  declare -A ms=() peak=()
  chains=0 pairs=0
  for _ in $(seq "$ROUNDS"); do
    for mode in eager plain fused; do
      line=$("$B" --mode "$mode" --precision "$prec" --threads 2 "$@" | grep '^{')
      ms[$mode]+="$(echo "$line" | sed 's/.*"median_ms":\([0-9.]*\).*/\1/') "
      peak[$mode]=$(echo "$line" | sed 's/.*"peak_bytes":\([0-9]*\).*/\1/')
      if [ "$mode" = fused ]; then
        chains=$(echo "$line" | sed 's/.*"chains":\([0-9]*\).*/\1/')
        pairs=$(echo "$line" | sed 's/.*"pairs":\([0-9]*\).*/\1/')
      fi
    done
  done
  /usr/bin/python3 - "$prec" "${ms[eager]}" "${ms[plain]}" "${ms[fused]}" "${peak[eager]}" "${peak[fused]}" "$chains" "$pairs" <<'PY'
import statistics, sys
prec, e, p, f, ep, fp, chains, pairs = sys.argv[1:9]
e, p, f = (statistics.median(map(float, v.split())) for v in (e, p, f))
print(f"| {prec} | {e:.2f} | {p:.2f} | {f:.2f} | {f / e:.3f} | {int(ep) / 2**20:.1f} | {int(fp) / 2**20:.1f} | {chains} | {pairs} |")
PY
  unset ms peak
done
