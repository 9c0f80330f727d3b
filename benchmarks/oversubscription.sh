#!/usr/bin/env bash
# Trainers sharing a machine (Note [OpenMP on a shared machine], backends/cpu/kernels.cpp): the wall time of
# one tiny-GPT trainer alone, then of 2 and of 4 started together (each --threads 2), as the ratio of each
# concurrent trainer's time to the time alone. Run once with the library's bounded spinning (the default)
# and once with libgomp's own default restored (GOMP_SPINCOUNT=300000), alternating, in the same run.
# Targets (issue 28): two trainers each <= 2.3x their time alone, four <= 4.6x; alone not slower than before.
#   bash benchmarks/oversubscription.sh build/release/examples/gpt/train_gpt [STEPS=150] [ROUNDS=2]
set -euo pipefail
T=$(realpath "$1")
STEPS=${2:-150}
ROUNDS=${3:-2}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cd "$W"
unset OMP_NUM_THREADS OMP_WAIT_POLICY GOMP_SPINCOUNT
ARGS=(--steps "$STEPS" --threads 2)

# one_batch N ENV: starts N trainers at once with environment ENV ("-" for none); prints each one's seconds.
one_batch() {
  local n=$1 envv=$2 pids=() i
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
  for setting in bounded default; do
    envv=-
    [ "$setting" = default ] && envv=GOMP_SPINCOUNT=300000
    alone[$setting]+="$(one_batch 1 "$envv") "
    two[$setting]+="$(one_batch 2 "$envv" | tr '\n' ' ')"
    four[$setting]+="$(one_batch 4 "$envv" | tr '\n' ' ')"
    echo "round $r $setting: alone ${alone[$setting]##* } ..." >&2
  done
done

echo "| spinning | alone s (median of $ROUNDS) | 2 together: s each (median) | ratio | 4 together: s each (median) | ratio |"
echo "|---|---|---|---|---|---|"
for setting in bounded default; do
  a=$(echo "${alone[$setting]}" | tr ' ' '\n' | grep . | median)
  t2=$(echo "${two[$setting]}" | tr ' ' '\n' | grep . | median)
  t4=$(echo "${four[$setting]}" | tr ' ' '\n' | grep . | median)
  name="typegrad's bound (GOMP_SPINCOUNT unset)"
  [ "$setting" = default ] && name="libgomp's default (GOMP_SPINCOUNT=300000)"
  printf '| %s | %.1f | %.1f | %.2fx | %.1f | %.2fx |\n' "$name" "$a" "$t2" "$(awk -v x="$t2" -v y="$a" 'BEGIN {print x / y}')" "$t4" "$(awk -v x="$t4" -v y="$a" 'BEGIN {print x / y}')"
done
echo "tiny GPT, train_gpt ${ARGS[*]}, $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
