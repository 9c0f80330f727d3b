#!/usr/bin/env bash
# The trainer's checkpoint flags end to end (tiny GPT on the fortunes corpus, dropout, accumulation):
#  1. a run saved at step 3 and resumed with --resume <file> gives the same step-4..6 log lines and
#     byte-identical tensors in its step-6 checkpoint as the uninterrupted run;
#  2. a trainer SIGKILLed mid-run resumes with --resume <dir> (the latest complete checkpoint) and ends
#     with the same weights as the uninterrupted run;
#  3. --init-from loads weights only; --init-from with --resume, or a missing checkpoint, is an error.
#   tests/io/trainer_resume.sh build/cpu/examples/gpt/train_gpt /tmp/work
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
T=$1
W=$2
rm -rf "$W" && mkdir -p "$W" && cd "$W"
export OMP_NUM_THREADS=1
if [ ! -d /usr/share/games/fortunes ]; then echo "SKIP: no fortunes corpus (package fortunes)"; exit 77; fi
C=(--warmup 2 --batch 4 --seq 32 --grad-accum 2 --dropout 0.1 --eval-every 0 --eval-batches 1 --sample-tokens 8)
A=(--steps 6 "${C[@]}")

# Compares the tensor bytes (everything after the header) of two safetensors files.
same_tensors() { /usr/bin/python3 "$HERE/same_tensors.py" "$1" "$2"; }
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),"lr":\([^,]*\),.*/\1 \2 \3/p' "$1"; }

"$T" "${A[@]}" --save-dir full --save-every 3 --keep 0 --log full.jsonl > full.out
[ -f full/ckpt-00000003.safetensors ] && [ -f full/ckpt-00000006.safetensors ]
"$T" "${A[@]}" --save-dir resumed --resume full/ckpt-00000003.safetensors --log resumed.jsonl > resumed.out
grep -q "resumed from full/ckpt-00000003.safetensors at step 3" resumed.out
diff <(losses full.jsonl | sed -n '4,6p') <(losses resumed.jsonl)
same_tensors full/ckpt-00000006.safetensors resumed/ckpt-00000006.safetensors
echo "1. resume from step 3: steps 4-6 losses and step-6 tensors identical"

# 1b. The same in fp16: the dynamic loss scaler's state (scale, growth tracker, skipped steps) travels in
# the checkpoint, so the resumed run's loss scale and skipped-step count continue the uninterrupted run's.
scaled() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),.*"loss_scale":\([^,]*\),"skipped_steps":\([0-9]*\).*/\1 \2 \3 \4/p' "$1"; }
"$T" "${A[@]}" --precision fp16 --save-dir full16 --save-every 3 --keep 0 --log full16.jsonl > full16.out
"$T" "${A[@]}" --precision fp16 --save-dir resumed16 --resume full16/ckpt-00000003.safetensors --log resumed16.jsonl > resumed16.out
[ "$(scaled full16.jsonl | wc -l)" = 6 ]
diff <(scaled full16.jsonl | sed -n '4,6p') <(scaled resumed16.jsonl)
same_tensors full16/ckpt-00000006.safetensors resumed16/ckpt-00000006.safetensors
echo "1b. fp16 resume from step 3: steps 4-6 losses, loss scale, skipped steps and step-6 tensors identical ($(scaled full16.jsonl | tail -1))"

# 2. SIGKILL during training, resume from the directory.
B=(--steps 30 "${C[@]}")
"$T" "${B[@]}" --save-dir ref --save-every 30 > ref.out
"$T" "${B[@]}" --save-dir killed --save-every 1 --keep 2 > killed1.out &
pid=$!
for _ in $(seq 1 2000); do
  [ -f killed/ckpt-00000005.safetensors ] && break
  sleep 0.01
done
kill -KILL $pid
wait $pid 2>/dev/null || true
last=$(ls killed | grep -E '^ckpt-[0-9]+\.safetensors$' | tail -1)
echo "   killed; the directory holds: $(ls -A killed | tr '\n' ' ')"
[ "$last" != "ckpt-00000030.safetensors" ] || { echo "the trainer finished before the kill"; exit 1; }
"$T" "${B[@]}" --save-dir killed --save-every 1 --keep 2 --resume killed > killed2.out
grep "resumed from" killed2.out
same_tensors ref/ckpt-00000030.safetensors killed/ckpt-00000030.safetensors
[ "$(ls killed | grep -c '^ckpt-')" = 2 ]
echo "2. SIGKILL at $last, resumed from the directory: step-30 tensors identical; --keep 2 honoured"

# 2b. SIGKILL inside the 3rd save (half of its bytes written; test hook of Note [atomic file replacement]).
TG_IO_TEST_PAUSE=mid-write TG_IO_TEST_PAUSE_AT=3 TG_IO_TEST_PAUSE_MARKER="$W/paused" \
  "$T" "${B[@]}" --save-dir insave --save-every 1 --keep 2 > insave1.out &
pid=$!
for _ in $(seq 1 2000); do
  [ -f paused ] && break
  sleep 0.01
done
[ -f paused ] || { echo "the trainer never reached the save hook"; kill -KILL $pid; exit 1; }
kill -KILL $pid
wait $pid 2>/dev/null || true
echo "   killed inside the save of step 3; the directory holds: $(ls -A insave | tr '\n' ' ')"
ls -A insave | grep -q '^\.ckpt-00000003\.safetensors\.tmp-'
[ "$(ls insave | grep -E '^ckpt-' | tail -1)" = ckpt-00000002.safetensors ]
"$T" "${B[@]}" --save-dir insave --save-every 1 --keep 2 --resume insave > insave2.out
grep -q "resumed from insave/ckpt-00000002.safetensors at step 2" insave2.out
same_tensors ref/ckpt-00000030.safetensors insave/ckpt-00000030.safetensors
[ -z "$(ls -A insave | grep tmp || true)" ]
echo "2b. SIGKILL mid-write of checkpoint 3: resumed from step 2, step-30 tensors identical, stale temporary removed"

# 3. --init-from and errors.
"$T" --steps 3 "${C[@]}" --init-from full/ckpt-00000006.safetensors > init.out
grep -q "initialized the weights from full/ckpt-00000006.safetensors" init.out
if "$T" "${A[@]}" --init-from full/ckpt-00000006.safetensors --resume full > err1.out 2>&1; then exit 1; fi
grep -q "exclude each other" err1.out
mkdir -p empty
if "$T" "${A[@]}" --resume empty > err2.out 2>&1; then exit 1; fi
grep -q "no checkpoint" err2.out
head -c 1000 full/ckpt-00000006.safetensors > trunc.safetensors
if "$T" "${A[@]}" --resume trunc.safetensors > err3.out 2>&1; then exit 1; fi
grep -q "trunc.safetensors" err3.out && grep -q "truncated" err3.out
echo "3. --init-from works; conflicting flags, an empty directory and a truncated checkpoint are errors: $(cat err3.out)"
echo "trainer_resume: PASS"
