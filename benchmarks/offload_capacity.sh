#!/usr/bin/env bash
# The largest GPT that trains on this machine's GPU with and without --offload (Note [optimizer offload];
# docs/distributed.md): for a fixed number of blocks, the widths of WIDTHS are tried from the smallest, each
# with 2 bf16 AdamW steps of 1 x SEQ tokens, blocks recomputed (so the model's states, not its activations,
# decide), until one fails; the last width that trained is reported, with its parameter count and the peak
# device memory the trainer printed. Without offload a parameter costs about 4 (fp32 weight) + 4 (gradient)
# + 8 (AdamW moments) + 2 (bf16 copy) bytes on the GPU; with it 10 (the moments go to the host, with an fp32
# master and a gradient copy: host memory bounds it too).
# A width whose offloaded states (about 16 bytes a parameter: master, gradient copy and moments, by 12 · LAYERS ·
# width² parameters) would not fit in the host's available memory is not tried: the table names it. The runs share
# a deadline (BUDGET seconds, 420 by default: a device call's worth), each at most RUN_LIMIT seconds (150).
#   bash benchmarks/offload_capacity.sh build/release/examples/gpt/train_gpt            # LAYERS=32 SEQ=1024
#   LAYERS=48 WIDTHS="2048 3072 4096" bash benchmarks/offload_capacity.sh build/release/examples/gpt/train_gpt
set -uo pipefail
T=$(realpath "$1")
W=${2:-/tmp/offload-capacity}
SRC=$(cd "$(dirname "$0")/.." && pwd)
LAYERS=${LAYERS:-32}
SEQ=${SEQ:-1024}
WIDTHS=${WIDTHS:-"2048 3072 4096 5120 6144 7168"}
BUDGET=${BUDGET:-420}
RUN_LIMIT=${RUN_LIMIT:-150}
START=$(date +%s)
mkdir -p "$W" && cd "$W" || exit 1
DATA=()
if [ ! -d /usr/share/games/fortunes ]; then  # train_gpt's default corpus is absent: one that every checkout has
  cat "$SRC"/docs/*.md "$SRC"/README.md > corpus.txt
  DATA=(--data corpus.txt)
fi
HOST_KIB=$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo 2>/dev/null)
C=("${DATA[@]}" --device cuda --precision bf16 --checkpoint blocks --layers "$LAYERS" --batch 1 --seq "$SEQ" --steps 2
   --warmup 0 --eval-every 0 --eval-batches 1 --sample-tokens 1 --lr 1e-4)
echo "| offload | blocks | largest width that trains | parameters | device peak | first width that fails |"
echo "|---|---|---|---|---|---|"
for off in "" "--offload"; do
  best="-" params="-" peak="-" failed="-"
  for w in $WIDTHS; do
    name="w$w${off:+-offload}"
    left=$((BUDGET - ($(date +%s) - START)))
    limit=$((left < RUN_LIMIT ? left : RUN_LIMIT))
    if [ "$limit" -lt 20 ]; then
      failed="$w (not tried: the ${BUDGET} s budget is spent)"
      break
    fi
    if [ -n "$off" ] && [ -n "$HOST_KIB" ] && [ $((16 * 12 * LAYERS * w * w / 1024)) -gt $((HOST_KIB * 9 / 10)) ]; then
      failed="$w (not tried: about $((16 * 12 * LAYERS * w * w >> 30)) GiB of host memory, $((HOST_KIB >> 20)) GiB available)"
      break
    fi
    if timeout -k 5 "$limit" "$T" "${C[@]}" --width "$w" --heads $((w / 128)) $off > "$name.out" 2> "$name.err"; then
      best=$w
      params=$(sed -n 's/.*, \([0-9.]*M\) parameters.*/\1/p' "$name.out" | head -1)
      peak=$(sed -n 's/.*memory *peak \([0-9.]* [MG]iB\).*/\1/p' "$name.out" | head -1)
    else
      rc=$?
      if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then failed="$w (timed out after $limit s)"
      else failed="$w ($(tail -1 "$name.err" | cut -c1-80))"; fi
      break
    fi
  done
  echo "| ${off:-no} | $LAYERS | $best | $params | $peak | $failed |"
done
