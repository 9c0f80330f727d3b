#!/usr/bin/env bash
# A short end-to-end smoke test of train_gpt, sized for the sanitizer stage (scripts/sanitize.sh runs it
# under ASan + UBSan; it runs in the release suite too): a few tiny steps in fp32, bf16 and fp16 (with
# accumulation, dropout, activation checkpointing), a --save-dir / --resume round trip (the resumed steps
# log the same losses), --init-from, --offload (the same losses, resuming the run's checkpoints), and bad inputs (missing, corrupt or truncated checkpoints, a file that
# is not a checkpoint, bad flags), each of which must end with a clear error: an exit code 1 or 2, a
# message, and no sanitizer report.
#   tests/trainer/train_gpt_smoke.sh build/asan/examples/gpt/train_gpt /tmp/work
set -euo pipefail
T=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
W=$2
rm -rf "$W" && mkdir -p "$W" && cd "$W"
export OMP_NUM_THREADS=1
if [ ! -d /usr/share/games/fortunes ]; then echo "SKIP: no fortunes corpus (package fortunes)"; exit 77; fi
C=(--batch 2 --seq 16 --warmup 0 --eval-every 0 --eval-batches 1 --sample-tokens 4)

# A sanitizer report in a log fails the test whatever the exit code was.
no_report() {
  if grep -qE "ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|SUMMARY: (Address|Undefined|Leak)" "$@"; then
    echo "FAIL: sanitizer report in $*"
    cat "$@"
    exit 1
  fi
}
ok() {  # ok <name> <args...>: runs train_gpt, which must succeed
  local name=$1 rc=0
  shift
  "$T" "$@" >"$name.out" 2>"$name.err" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAIL: train_gpt $* exited with $rc"
    cat "$name.out" "$name.err"
    exit 1
  fi
  no_report "$name.out" "$name.err"
}
fails() {  # fails <name> <pattern> <args...>: train_gpt must exit 1 or 2 with <pattern> on stderr
  local name=$1 pattern=$2 rc=0
  shift 2
  "$T" "$@" >"$name.out" 2>"$name.err" || rc=$?
  no_report "$name.out" "$name.err"
  if [ "$rc" -ne 1 ] && [ "$rc" -ne 2 ]; then
    echo "FAIL: train_gpt $* exited with $rc, expected an error exit (1 or 2)"
    cat "$name.out" "$name.err"
    exit 1
  fi
  if ! grep -qE "$pattern" "$name.err"; then
    echo "FAIL: train_gpt $*: stderr does not match '$pattern':"
    cat "$name.err"
    exit 1
  fi
}
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),"lr":\([^,]*\),.*/\1 \2 \3/p' "$1"; }

# 1. Training in each precision, with accumulation, dropout and recomputed blocks.
ok fp32 --steps 4 "${C[@]}" --save-dir ck --save-every 2 --keep 0 --log fp32.jsonl
[ -f ck/ckpt-00000002.safetensors ] && [ -f ck/ckpt-00000004.safetensors ]
ok bf16 --steps 2 "${C[@]}" --precision bf16 --grad-accum 2 --dropout 0.1
ok fp16 --steps 2 "${C[@]}" --precision fp16 --checkpoint blocks
echo "1. fp32, bf16 (accumulation, dropout) and fp16 (recomputed blocks) train"

# 2. Resume from step 2: steps 3-4 log the same losses and learning rates as the uninterrupted run.
ok resumed --steps 4 "${C[@]}" --resume ck/ckpt-00000002.safetensors --log resumed.jsonl
diff <(losses fp32.jsonl | sed -n '3,4p') <(losses resumed.jsonl)
ok init --steps 1 "${C[@]}" --init-from ck/ckpt-00000004.safetensors
grep -q "initialized the weights from ck/ckpt-00000004.safetensors" init.out
# --offload (Note [optimizer offload]): on the CPU the same update, so the same losses; it resumes a checkpoint
# written without it, and the other way round.
ok offload --steps 4 "${C[@]}" --offload --log offload.jsonl
grep -q "optimizer offload: the AdamW state and update on the host" offload.out
diff <(losses fp32.jsonl) <(losses offload.jsonl)
ok offload_resumed --steps 4 "${C[@]}" --offload --resume ck/ckpt-00000002.safetensors --log offload_resumed.jsonl
diff <(losses fp32.jsonl | sed -n '3,4p') <(losses offload_resumed.jsonl)
ok shape --steps 1 "${C[@]}" --layers 1 --width 48 --heads 3
grep -q "L=1 H=3 C=48" shape.out
echo "2. --resume continues with identical losses; --init-from loads the weights; --offload trains and resumes alike; --layers/--width/--heads"

# --compile (Note [compiled steps in the trainer]): bitwise the eager losses, with dropout and accumulation; it
# resumes an eager run's checkpoint alike. --plan prints one step's plan and writes nothing; --memory-budget
# picks a checkpointing or stops before step 1 naming the smallest planned peak.
ok compiled --steps 4 "${C[@]}" --compile --log compiled.jsonl
# the GPT blocks call fused ops; without dropout each block's last residual add and the next LayerNorm are a pair
# (Note [pair rewrites]): found at step 1, captured fused at step 2, replayed from step 3
grep -q "compiled step: captured at step 2; its memory plan:" compiled.out
grep -q "compile           2 capture(s), 2 replays, 0 fused chains, 4 fused pairs" compiled.out
diff <(losses fp32.jsonl) <(losses compiled.jsonl)
ok compiled_bf16 --steps 3 "${C[@]}" --compile --precision bf16 --grad-accum 2 --dropout 0.1 --log compiled_bf16.jsonl
ok eager_bf16 --steps 3 "${C[@]}" --precision bf16 --grad-accum 2 --dropout 0.1 --log eager_bf16.jsonl
diff <(losses eager_bf16.jsonl) <(losses compiled_bf16.jsonl)
ok compiled_resumed --steps 4 "${C[@]}" --compile --resume ck/ckpt-00000002.safetensors --log compiled_resumed.jsonl
diff <(losses fp32.jsonl | sed -n '3,4p') <(losses compiled_resumed.jsonl)
ok plan --steps 4 "${C[@]}" --plan --log plan.jsonl --save-dir plan_ck
grep -q "memory plan of one step (--checkpoint none):" plan.out
grep -q "activations kept for backward" plan.out
[ ! -e plan.jsonl ] && [ ! -e plan_ck ] || { echo "FAIL: --plan wrote a log or a checkpoint"; exit 1; }
ok budget --steps 2 "${C[@]}" --memory-budget 4G
grep -q "memory budget 4.00 GiB: planned peaks none .*: training with --checkpoint none" budget.out
fails small_budget "no activation checkpointing fits it; the smallest planned peak is .* \(--checkpoint [a-z]+\)" --steps 2 "${C[@]}" --memory-budget 64K
fails budget_unit "unknown unit 'X'" --steps 1 --memory-budget 5X
fails budget_and_checkpoint "give it without --checkpoint" --steps 1 --memory-budget 1G --checkpoint blocks
fails no_fuse_alone "give it with one of them" --steps 1 --no-fuse
echo "2b. --compile logs the eager losses bit for bit and resumes; --plan prints the plan; --memory-budget chooses or stops"

# --device-boundary (Note [the step boundary on the device]): the boundary's kernels decide the step; on the CPU
# the losses are the host boundary's bit for bit (fp32 with clipping, fp16 with its scaler and accumulation,
# compiled, LAMB with clipping, Adafactor with fp16's scaler).
ok boundary --steps 4 "${C[@]}" --device-boundary --log boundary.jsonl
grep -q "step boundary on the device" boundary.out
diff <(losses fp32.jsonl) <(losses boundary.jsonl)
ok eager_fp16 --steps 3 "${C[@]}" --precision fp16 --grad-accum 2 --dropout 0.1 --log eager_fp16.jsonl
ok boundary_fp16 --steps 3 "${C[@]}" --precision fp16 --grad-accum 2 --dropout 0.1 --device-boundary --compile --log boundary_fp16.jsonl
diff <(losses eager_fp16.jsonl) <(losses boundary_fp16.jsonl)
ok lamb --steps 3 "${C[@]}" --optimizer lamb --clip 0.5 --log lamb.jsonl
ok boundary_lamb --steps 3 "${C[@]}" --optimizer lamb --clip 0.5 --device-boundary --log boundary_lamb.jsonl
diff <(losses lamb.jsonl) <(losses boundary_lamb.jsonl)
ok adafactor --steps 3 "${C[@]}" --optimizer adafactor --precision fp16 --log adafactor.jsonl
ok boundary_adafactor --steps 3 "${C[@]}" --optimizer adafactor --precision fp16 --device-boundary --log boundary_adafactor.jsonl
diff <(losses adafactor.jsonl) <(losses boundary_adafactor.jsonl)
# --graph-report (Note [graph blockers]): with the boundary on the device a compiled step launches the same kernels
# with the same arguments every step; with it on the host, its dropouts' offsets change and its boundary reads.
ok graph --steps 5 "${C[@]}" --precision fp16 --grad-accum 2 --dropout 0.1 --device-boundary --compile --graph-report
grep -Eq "graph report: [0-9]+ launches per step, 0 that a graph could not repeat" graph.out
ok graph_host --steps 5 "${C[@]}" --precision bf16 --grad-accum 2 --dropout 0.1 --compile --graph-report
grep -Eq "graph report: [0-9]+ launches per step, [1-9][0-9]* that a graph could not repeat \(.*dropout_forward" graph_host.out
fails graph_eager "give it with --compile" --steps 1 --graph-report
fails cuda_graphs_cpu "give it with --compile and --device cuda" --steps 1 --compile --cuda-graphs
fails graph_chunk_alone "give it with --cuda-graphs" --steps 1 --compile --graph-chunk 8
echo "2c. --device-boundary logs the host boundary's losses bit for bit (AdamW, fp16 compiled, LAMB, Adafactor in fp16)"

# 3. Bad inputs end with a clear error, never a crash or a sanitizer report.
cp ck/ckpt-00000004.safetensors corrupt.safetensors
size=$(stat -c %s corrupt.safetensors)
printf '\x55' | dd of=corrupt.safetensors bs=1 seek=$((size - 7)) conv=notrunc status=none
head -c $((size / 2)) ck/ckpt-00000004.safetensors > truncated.safetensors
printf 'not a safetensors file\n' > text.safetensors
fails missing_resume "error" --steps 1 "${C[@]}" --resume does-not-exist.safetensors
fails corrupt_resume "error.*(checksum|crc)" --steps 4 "${C[@]}" --resume corrupt.safetensors
fails truncated_resume "error" --steps 4 "${C[@]}" --resume truncated.safetensors
fails corrupt_init "error.*(checksum|crc)" --steps 1 "${C[@]}" --init-from corrupt.safetensors
fails text_init "error" --steps 1 "${C[@]}" --init-from text.safetensors
fails missing_data "error" --steps 1 "${C[@]}" --data does-not-exist.txt
fails bad_batch "batch" --steps 1 --batch 0 --seq 16
fails bad_flag "unknown|not expected|extra" --steps 1 --no-such-flag
fails bad_shape "width 100 is not a multiple of --heads 3" --steps 1 --width 100 --heads 3
fails bad_dist_bucket "bucket-mb must be a positive number" --steps 1 --dist ddp --bucket-mb 0
echo "3. missing, corrupt, truncated and non-checkpoint files, a missing corpus and bad flags: clear errors"
echo "OK: train_gpt smoke test"
