#!/usr/bin/env bash
# Trainers sharing a machine (Note [OpenMP on a shared machine], Note [threads under contention],
# backends/cpu/kernels.cpp): the wall time of one tiny-GPT trainer alone, then of 2 and of 4 started
# together, as the ratio of each concurrent trainer's time to the time alone, for three settings,
# alternated in the same run:
#   auto     the library's defaults: the team sized to the CPUs other programs leave, bounded spinning
#   pinned   --threads 2 (a pinned team) with bounded spinning
#   before   --threads 2 with libgomp's own spinning (GOMP_SPINCOUNT=300000): the library before both
# Targets (issue 28): two trainers each <= 2.3x their time alone, four <= 4.6x; alone not slower than before.
#   bash benchmarks/oversubscription.sh build/release/examples/gpt/train_gpt [STEPS=150] [ROUNDS=2] [SETTINGS="auto pinned before"]
set -euo pipefail
T=$(realpath "$1")
STEPS=${2:-150}
ROUNDS=${3:-2}
SETTINGS=${4:-auto pinned before}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cd "$W"
unset OMP_NUM_THREADS OMP_WAIT_POLICY GOMP_SPINCOUNT

# one_batch N SETTING: starts N trainers at once; prints each one's seconds.
one_batch() {
  local n=$1 setting=$2 pids=() i envv=-
  local ARGS=(--steps "$STEPS")
  [ "$setting" = auto ] || ARGS+=(--threads 2)
  [ "$setting" = before ] && envv=GOMP_SPINCOUNT=300000
  for i in $(seq 1 "$n"); do
    if [ "$envv" = - ]; then
      ( s=$(date +%s.%N); "$T" "${ARGS[@]}" > "run$i.out" 2>&1; e=$(date +%s.%N); awk -v a="$s" -v b="$e" 'BEGIN {print b - a}' > "t$i" ) &
    else
      ( s=$(date +%s.%N); env "$envv" "$T" "${ARGS[@]}" > "run$i.out" 2>&1; e=$(date +%s.%N); awk -v a="$s" -v b="$e" 'BEGIN {print b - a}' > "t$i" ) &
    fi
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for i in $(seq 1 "$n"); do
    grep -q "^summary" "run$i.out" || { echo "a trainer failed:" >&2; tail -5 "run$i.out" >&2; exit 1; }
    cat "t$i"
  done
}
median() { sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

declare -A alone two four
for r in $(seq 1 "$ROUNDS"); do
  for setting in $SETTINGS; do
    alone[$setting]+="$(one_batch 1 "$setting") "
    two[$setting]+="$(one_batch 2 "$setting" | tr '\n' ' ')"
    four[$setting]+="$(one_batch 4 "$setting" | tr '\n' ' ')"
    echo "round $r $setting done" >&2
  done
done

echo "| setting | alone s (median of $ROUNDS) | 2 together: s each (median) | ratio | 4 together: s each (median) | ratio |"
echo "|---|---|---|---|---|---|"
for setting in $SETTINGS; do
  a=$(echo "${alone[$setting]}" | tr ' ' '\n' | grep . | median)
  t2=$(echo "${two[$setting]}" | tr ' ' '\n' | grep . | median)
  t4=$(echo "${four[$setting]}" | tr ' ' '\n' | grep . | median)
  case $setting in
    auto) name="auto (no --threads): adaptive team, bounded spin" ;;
    pinned) name="--threads 2, bounded spin" ;;
    before) name="--threads 2, GOMP_SPINCOUNT=300000 (before)" ;;
  esac
  printf '| %s | %.1f | %.1f | %.2fx | %.1f | %.2fx |\n' "$name" "$a" "$t2" "$(awk -v x="$t2" -v y="$a" 'BEGIN {print x / y}')" "$t4" "$(awk -v x="$t4" -v y="$a" 'BEGIN {print x / y}')"
done
echo "tiny GPT, train_gpt --steps $STEPS, $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
