#!/usr/bin/env bash
# The compression figures of docs/compression.md, end to end on the fortunes corpus with fixed seeds:
#  1. a teacher: the small preset trained from scratch;
#  2. int8 post-training quantization of the teacher (dynamic per-token and static calibrated scales): the
#     validation loss beside fp32 and bf16, and the time of one forward;
#  3. pruning: the teacher fine-tuned under gradual magnitude pruning to 25/50/75/90% and under 2:4, against the
#     same fine-tuning without pruning (0%), each row's validation loss;
#  4. distillation: tiny students distilled from the teacher against the same students trained from scratch,
#     three seeds each (mean and spread).
# Prints markdown tables; every run's output stays in OUT (a teacher already there is reused). PARTS picks
# the parts after the teacher (default: all three).
#   bash benchmarks/compression.sh build/release/examples/gpt/train_gpt /tmp/compression [THREADS]
#   PARTS="prune distill" bash benchmarks/compression.sh ...
set -euo pipefail
T=$(realpath "$1")
OUT=$2
THREADS=${3:-2}
mkdir -p "$OUT" && cd "$OUT"
export OMP_NUM_THREADS=$THREADS

TEACHER_STEPS=${TEACHER_STEPS:-600}
PRUNE_STEPS=${PRUNE_STEPS:-150}
STUDENT_STEPS=${STUDENT_STEPS:-600}
PARTS=${PARTS:-"ptq prune distill"}
EVAL=(--eval-batches 32)
val() { sed -n 's/^  val loss *\([0-9.]*\) at the end.*/\1/p' "$1"; }

# 1. The teacher.
if [ ! -f teacher/ckpt-$(printf %08d "$TEACHER_STEPS").safetensors ]; then
  "$T" --model small --steps "$TEACHER_STEPS" --batch 8 --seq 128 --lr 1e-3 --warmup 50 --eval-every 0 "${EVAL[@]}" \
       --seed 1 --save-dir teacher --keep 1 --threads "$THREADS" > teacher.out
fi
CKPT=teacher/ckpt-$(printf %08d "$TEACHER_STEPS").safetensors
echo "teacher: small preset, $TEACHER_STEPS steps of 8x128 tokens ($CKPT; its fp32 validation loss heads the int8 table)"

# 2. int8 post-training quantization.
if [[ " $PARTS " == *" ptq "* ]]; then
echo
echo "| model | val loss | vs fp32 | size | forward ms (16x128) |"
echo "|---|---|---|---|---|"
for q in int8 int8-static; do
  "$T" --model small --eval-only --init-from "$CKPT" --quantize "$q" --batch 16 --seq 128 "${EVAL[@]}" \
       --calibration-batches 8 --threads "$THREADS" > "ptq-$q.out"
done
awk '/^  (fp32|bf16|int8) /{printf "| %s | %s | %s | %s %s | %s |\n", $1, $2, $4, $5, $6, $7}' ptq-int8.out
awk '/^  int8 /{printf "| int8 (static, 8 calibration batches) | %s | %s | %s %s | %s |\n", $2, $4, $5, $6, $7}' ptq-int8-static.out
grep "forward speed" ptq-int8.out
grep "forward speed" ptq-int8-static.out
fi

# 3. Pruning: fine-tuning from the teacher, the ramp over the first two thirds of the steps.
if [[ " $PARTS " == *" prune "* ]]; then
echo
echo "| pruning | sparsity | val loss | vs dense fine-tuning |"
echo "|---|---|---|---|"
RAMP=$((PRUNE_STEPS * 2 / 3))
F=(--model small --init-from "$CKPT" --steps "$PRUNE_STEPS" --batch 8 --seq 128 --lr 3e-4 --warmup 10 --eval-every 0 "${EVAL[@]}"
   --seed 2 --threads "$THREADS")
"$T" "${F[@]}" > prune-0.out
dense=$(val prune-0.out)
echo "| none (dense fine-tuning) | 0% | $dense | |"
for s in 0.25 0.5 0.75 0.9; do
  "$T" "${F[@]}" --prune "unstructured:$s" --prune-start 0 --prune-end "$RAMP" --prune-every 5 > "prune-$s.out"
  v=$(val "prune-$s.out")
  echo "| unstructured, gradual, global | $(/usr/bin/python3 -c "print(round(100 * $s))")% | $v | $(/usr/bin/python3 -c "print('%+.2f%%' % (100 * ($v / $dense - 1)))") |"
done
"$T" "${F[@]}" --prune 2:4 > prune-24.out
v=$(val prune-24.out)
echo "| 2:4 (one-shot, then fine-tuned) | 50% | $v | $(/usr/bin/python3 -c "print('%+.2f%%' % (100 * ($v / $dense - 1)))") |"
fi

# 4. Distillation: tiny students, three seeds, distilled vs from scratch with the same steps and data.
if [[ " $PARTS " == *" distill "* ]]; then
echo
S=(--model tiny --steps "$STUDENT_STEPS" --batch 8 --seq 128 --lr 2e-3 --warmup 30 --eval-every 0 "${EVAL[@]}" --threads "$THREADS")
for seed in 11 12 13; do
  "$T" "${S[@]}" --seed "$seed" > "scratch-$seed.out"
  "$T" "${S[@]}" --seed "$seed" --distill-from "$CKPT" --distill-alpha 0.5 --distill-temperature 2 > "distill-$seed.out"
done
/usr/bin/python3 - <<'EOF'
import re, statistics
def val(p):
    return float(re.search(r"^  val loss *([0-9.]+) at the end", open(p).read(), re.M).group(1))
rows = {k: [val("%s-%d.out" % (k, s)) for s in (11, 12, 13)] for k in ("scratch", "distill")}
print("| tiny student | seed 11 | seed 12 | seed 13 | mean | spread (max - min) |")
print("|---|---|---|---|---|---|")
for k, name in (("scratch", "from scratch"), ("distill", "distilled (alpha 0.5, tau 2)")):
    v = rows[k]
    print("| %s | %s | %.4f | %.4f |" % (name, " | ".join("%.4f" % x for x in v), statistics.mean(v), max(v) - min(v)))
EOF
fi
