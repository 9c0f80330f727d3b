#!/usr/bin/env bash
# Data-parallel figures on this machine (docs/performance.md, "Data parallelism"), with train_gpt --dist on the
# `small` preset (fortunes corpus, seq 128), every configuration run ROUNDS times, alternated:
#  1. overlap: the time a step waits on its gradient all-reduces with the reductions started from the
#     grad-ready hooks (--dist-overlap 1) and after backward (--dist-overlap 0), 2 ranks; hidden fraction =
#     1 - wait(overlap) / wait(no overlap);
#  2. 2 ranks x 1 thread against 1 process x 2 threads at the same global batch (8 x 128 tokens), tokens/s;
#  3. peak memory per rank (rank 0's allocator statistics) for one process, DDP, ZeRO-1 and ZeRO-2 on 2 ranks,
#     beside the ZeRO paper's model-state formulas for fp32 AdamW (weights 4Ψ, gradients 4Ψ, moments 8Ψ).
#   bash benchmarks/dist.sh build/release/examples/gpt/train_gpt /tmp/dist-bench 3
set -euo pipefail
T=$(realpath "$1")
W=${2:-/tmp/dist-bench}
ROUNDS=${3:-3}
mkdir -p "$W" && cd "$W"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
C=(--model small --seq 128 --steps 30 --warmup 5 --lr 6e-4 --eval-every 0 --eval-batches 1 --sample-tokens 4)
mpi() { OMP_NUM_THREADS=1 timeout 1200 mpiexec --oversubscribe -np 2 "$T" "${C[@]}" --threads 1 --batch 4 "$@"; }

for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r"
  mpi --dist ddp --dist-overlap 1 --bucket-mb 5 > "overlap-on-$r.out"
  mpi --dist ddp --dist-overlap 0 --bucket-mb 5 > "overlap-off-$r.out"
  OMP_NUM_THREADS=2 "$T" "${C[@]}" --threads 2 --batch 8 > "one-2threads-$r.out"
  mpi --dist ddp > "ddp-$r.out"
  mpi --dist zero1 > "zero1-$r.out"
  mpi --dist zero2 > "zero2-$r.out"
done

/usr/bin/python3 - "$ROUNDS" <<'PYEOF'
import re, statistics, sys
rounds = int(sys.argv[1])
def field(path, pattern):
    m = re.search(pattern, open(path).read())
    assert m, (path, pattern)
    return float(m.group(1))
def speed(p): return field(p, r"speed\s+([\d.]+) ms/step, (?:[\d.]+) tokens/s"), field(p, r"speed\s+[\d.]+ ms/step, ([\d.]+) tokens/s")
def wait(p): return field(p, r"communication\s+\d+ ranks \(\w+\), ([\d.]+) ms/step waited")
def peak(p):
    m = re.search(r"memory\s+peak ([\d.]+) (MiB|GiB)", open(p).read())
    return float(m.group(1)) * (1024 if m.group(2) == "GiB" else 1)
def params(p): return field(p, r"([\d.]+)M parameters") * 1e6
med = lambda xs: statistics.median(xs)
R = range(1, rounds + 1)
on = [wait(f"overlap-on-{r}.out") for r in R]; off = [wait(f"overlap-off-{r}.out") for r in R]
on_ms = [speed(f"overlap-on-{r}.out")[0] for r in R]; off_ms = [speed(f"overlap-off-{r}.out")[0] for r in R]
print(f"\n## overlap (2 ranks x 1 thread, DDP, 5 MiB buckets, median of {rounds})")
print("| reductions start | step ms | waited on all-reduce ms/step |")
print("|---|---|---|")
print(f"| after backward (--dist-overlap 0) | {med(off_ms):.1f} | {med(off):.1f} |")
print(f"| from the grad-ready hooks (--dist-overlap 1) | {med(on_ms):.1f} | {med(on):.1f} |")
print(f"hidden behind backward: {100 * (1 - med(on) / med(off)):.0f}% of the all-reduce wait")
one = [speed(f"one-2threads-{r}.out")[1] for r in R]; two = [speed(f"ddp-{r}.out")[1] for r in R]
print(f"\n## 2 ranks x 1 thread vs 1 process x 2 threads (global batch 8 x 128, median of {rounds})")
print("| run | tokens/s |")
print("|---|---|")
print(f"| 1 process x 2 threads | {med(one):.0f} |")
print(f"| 2 ranks x 1 thread (DDP) | {med(two):.0f} |")
print(f"ratio 2 ranks / 1 process: {med(two) / med(one):.2f}")
psi = params("ddp-1.out"); mib = 1 / 2**20
base = med([peak(f"one-2threads-{r}.out") for r in R])
print(f"\n## peak memory per rank (rank 0, 2 ranks, fp32 AdamW, psi = {psi / 1e6:.2f}M parameters, median of {rounds})")
print("| run | measured peak MiB | model states by the formula MiB | formula | the rest (activations, temporaries) MiB |")
print("|---|---|---|---|---|")
print(f"| 1 process, batch 8 | {base:.1f} | {16 * psi * mib:.1f} | 4Ψ + 4Ψ + 8Ψ | {base - 16 * psi * mib:.1f} |")
for name, formula, k in (("ddp", "4Ψ + 4Ψ + 8Ψ", 16), ("zero1", "4Ψ + 4Ψ + 8Ψ/N", 8 + 8 / 2), ("zero2", "4Ψ + (4Ψ + 8Ψ)/N", 4 + 12 / 2)):
    m = med([peak(f'{name}-{r}.out') for r in R])
    print(f"| {name}, batch 4 per rank | {m:.1f} | {k * psi * mib:.1f} | {formula} | {m - k * psi * mib:.1f} |")
PYEOF
