#!/usr/bin/env bash
# Tensor and pipeline parallelism on this machine (docs/performance.md, "Model parallelism"): train_gpt --tp T
# --pp P on T·P ranks (one OpenMP thread each), the `small` preset, seq 128, batch 4, 4 micro-batches per step,
# 20 steps, for (T, P) in {1, 2} x {1, 2}, and T = 2 with --sequence-parallel. From rank 0 (stage 0, tensor
# rank 0): its parameters and fp32 weight bytes, the step's memory above what stays between steps (activations
# and temporaries; allocator statistics), the bytes it sent to its tensor-parallel group and its pipeline
# neighbours per step against their formulas, and the time it waited on its neighbours against the 1F1B bubble
# (p-1)/(m+p-1).
#   bash benchmarks/model_parallel.sh build/release/examples/gpt/train_gpt /tmp/mp-bench
set -euo pipefail
T=$(realpath "$1")
W=${2:-/tmp/mp-bench}
mkdir -p "$W" && cd "$W"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
C=(--model small --seq 128 --batch 4 --grad-accum 4 --steps 20 --warmup 2 --lr 6e-4 --eval-every 0 --eval-batches 1 --sample-tokens 4 --threads 1)
RUNS=("1 1" "1 2" "2 1" "2 2" "2 1 sp" "2 2 sp")
for r in "${RUNS[@]}"; do
  set -- $r
  timeout 1800 mpiexec --oversubscribe -np $(($1 * $2)) "$T" "${C[@]}" --tp "$1" --pp "$2" ${3:+--sequence-parallel} > "tp$1-pp$2${3:+-sp}.out"
done
/usr/bin/python3 - <<'PYEOF'
import re
def grab(text, pattern, cast=float):
    m = re.search(pattern, text)
    return cast(m.group(1)) if m else None
def mib(text, pattern):
    m = re.search(pattern, text)
    if not m: return None
    v, unit = float(m.group(1)), m.group(2)
    return v * 1024 if unit == "GiB" else v
print("| tp | pp | sequence parallel | rank 0 parameters (M) | rank 0 fp32 weights MiB | activations kept for backward MiB | step memory above the kept state MiB | peak MiB | "
      "TP sends MiB/step (formula) | PP sends MiB/step (formula) | waited on neighbours | 1F1B bubble | tokens/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for tp, pp, sp in ((1, 1, ""), (1, 2, ""), (2, 1, ""), (2, 2, ""), (2, 1, "-sp"), (2, 2, "-sp")):
        t = open(f"tp{tp}-pp{pp}{sp}.out").read()
        params = grab(t, r"rank 0 \(stage 0, tensor rank 0\): blocks \d+-\d+, ([\d.]+)M parameters")
        weights = mib(t, r"M parameters, ([\d.]+) (MiB|GiB) of fp32 weights")
        step = mib(t, r"step memory above the state kept between steps ([\d.]+) (MiB|GiB)")
        acts = mib(t, r"activations kept for backward ([\d.]+) (MiB|GiB)")
        peak = mib(t, r"memory\s+peak ([\d.]+) (MiB|GiB)")
        tpb = re.search(r"tensor-parallel sends ([\d.]+) MiB/step \(formula ([\d.]+)\)", t)
        ppb = re.search(r"pipeline sends ([\d.]+) MiB/step \(formula ([\d.]+)\)", t)
        wait = re.search(r"waited on its neighbours ([\d.]+)% of the step time \(the 1F1B bubble \(p-1\)/\(m\+p-1\) = ([\d.]+)%\)", t)
        tok = grab(t, r"speed\s+[\d.]+ ms/step, ([\d.]+) tokens/s")
        print(f"| {tp} | {pp} | {'yes' if sp else 'no'} | {params:.3f} | {weights:.1f} | {acts:.1f} | {step:.1f} | {peak:.1f} | {tpb.group(1)} ({tpb.group(2)}) | "
              f"{ppb.group(1)} ({ppb.group(2)}) | {wait.group(1) + '%' if wait else '-'} | {wait.group(2) + '%' if wait else '-'} | {tok:.0f} |")
PYEOF
