#!/usr/bin/env bash
# The trainer's compression flags end to end (tiny GPT on the fortunes corpus):
#  1. --prune with a gradual schedule: the masks are saved in checkpoints, and a run resumed mid-ramp gives
#     the same losses and byte-identical tensors (weights, optimizer state, masks) as the uninterrupted run;
#     the final sparsity is the target's; a pruned checkpoint resumed without --prune is an error;
#  2. 2:4 pruning from --init-from: every group of 4 input weights has 2 zeros after fine-tuning;
#  3. --distill-from a teacher checkpoint trains, and a teacher with another tokenizer is an error;
#  4. --eval-only --quantize int8 / int8-static print the float and int8 losses side by side, --quantize-save
#     writes a file; bad flag combinations are one-line errors (exit 2).
#   tests/quant/trainer_compression.sh build/release/examples/gpt/train_gpt /tmp/work
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
T=$1
W=$2
rm -rf "$W" && mkdir -p "$W" && cd "$W"
export OMP_NUM_THREADS=1
if [ ! -d /usr/share/games/fortunes ]; then echo "SKIP: no fortunes corpus (package fortunes)"; exit 77; fi
C=(--warmup 2 --batch 4 --seq 32 --eval-every 0 --eval-batches 2 --sample-tokens 8)

same_tensors() { /usr/bin/python3 "$HERE/../io/same_tensors.py" "$1" "$2"; }
# Checks a checkpoint's masks and weights: every prunable weight is zero where its mask is 0; prints the sparsity.
# With "24" as the third argument, also that every group of 4 along the input dimension has exactly 2 zeros.
check_masks() {
  /usr/bin/python3 - "$1" "$2" "${3:-}" <<'EOF'
import json, struct, sys
path, want, pattern = sys.argv[1], float(sys.argv[2]), sys.argv[3]
b = open(path, "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n]); data = b[8 + n:]
def get(name):
    t = h[name]; s, e = t["data_offsets"]; return t, data[s:e]
masks = [k for k in h if k.startswith("prune.mask.")]
assert masks, "no masks in " + path
zeros = total = 0
for m in masks:
    tm, mb = get(m)
    tw, wb = get(m[len("prune.mask."):])
    assert tm["dtype"] == "U8" and tm["shape"] == tw["shape"], m
    w = struct.unpack("<%df" % (len(wb) // 4), wb)
    for i, (mv, wv) in enumerate(zip(mb, w)):
        assert mv in (0, 1), (m, i, mv)
        if mv == 0: assert wv == 0.0, (m, i, wv)
    zeros += sum(1 for mv in mb if mv == 0); total += len(mb)
    if pattern == "24":
        rows, cols = tw["shape"]
        for r in range(rows):
            for g in range(0, cols, 4):
                assert sum(1 for mv in mb[r * cols + g:r * cols + g + 4] if mv == 0) == 2, (m, r, g)
s = zeros / total
assert abs(s - want) < 1e-3, (s, want)
print("%.4f" % s)
EOF
}
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),"lr":\([^,]*\),.*/\1 \2 \3/p' "$1"; }

# 1. Gradual unstructured pruning to 60% over steps 2..8, mask updates every 2 steps; resume at step 5.
P=(--steps 10 "${C[@]}" --prune unstructured:0.6 --prune-start 2 --prune-end 8 --prune-every 2)
"$T" "${P[@]}" --save-dir full --save-every 5 --keep 0 --log full.jsonl > full.out
grep -q "pruning: unstructured to 60% globally, steps 2..8 every 2" full.out
"$T" "${P[@]}" --save-dir resumed --resume full/ckpt-00000005.safetensors --log resumed.jsonl > resumed.out
diff <(losses full.jsonl | sed -n '6,10p') <(losses resumed.jsonl)
same_tensors full/ckpt-00000010.safetensors resumed/ckpt-00000010.safetensors
s5=$(check_masks full/ckpt-00000005.safetensors "$(/usr/bin/python3 -c 'print(0.6 + (0 - 0.6) * (1 - (4 - 2) / 6) ** 3)')")
s10=$(check_masks full/ckpt-00000010.safetensors 0.6)
echo "1. gradual pruning: sparsity $s5 at step 5 (mask update at step 4), $s10 at step 10; resumed at step 5: losses and tensors identical"
if "$T" "${C[@]}" --steps 10 --resume full/ckpt-00000005.safetensors > noprune.out 2> noprune.err; then
  echo "resuming a pruned checkpoint without --prune should fail"; exit 1
fi
grep -q "holds pruning masks" noprune.err

# 2. One-shot 2:4 pruning of a trained model, then fine-tuning.
"$T" --steps 6 "${C[@]}" --save-dir dense > dense.out
"$T" --steps 4 "${C[@]}" --init-from dense/ckpt-00000006.safetensors --prune 2:4 --save-dir two4 > two4.out
check_masks two4/ckpt-00000004.safetensors 0.5 24 > /dev/null
echo "2. 2:4 pruning from --init-from: every group of 4 has 2 zeros after 4 fine-tuning steps"

# 3. Distillation from the dense run's checkpoint (a teacher of the same preset here; any preset works).
"$T" --steps 4 "${C[@]}" --distill-from dense/ckpt-00000006.safetensors --distill-alpha 0.7 --distill-temperature 2 > distill.out
grep -q "distillation: teacher dense/ckpt-00000006.safetensors" distill.out
grep -q "summary" distill.out
if "$T" --steps 4 "${C[@]}" --tokenizer bpe:300 --distill-from dense/ckpt-00000006.safetensors > badteacher.out 2> badteacher.err; then
  echo "a teacher with another tokenizer should be an error"; exit 1
fi
grep -q "the teacher and the student must share their vocabulary" badteacher.err
echo "3. distillation trains; a teacher with another tokenizer is refused"

# 4. int8 evaluation.
"$T" "${C[@]}" --eval-only --init-from dense/ckpt-00000006.safetensors --quantize int8 --quantize-save q.safetensors > q.out
grep -q "^  fp32 " q.out && grep -q "^  bf16 " q.out && grep -q "^  int8 " q.out && [ -s q.safetensors ]
"$T" "${C[@]}" --eval-only --init-from dense/ckpt-00000006.safetensors --quantize int8-static --calibration-batches 2 > qs.out
grep -q "static (calibrated on training batches) activation scales over 2 batches" qs.out
for bad in "--quantize int8" "--eval-only --resume dense --quantize int8" "--eval-only --quantize-lm-head" \
           "--quantize-save x.safetensors" "--prune 3:4" "--prune unstructured:1.5" "--prune unstructured:0.5 --prune-start 5 --prune-end 3" \
           "--distill-from dense/ckpt-00000006.safetensors --distill-alpha 2"; do
  set +e
  # shellcheck disable=SC2086
  "$T" --steps 10 "${C[@]}" $bad > bad.out 2> bad.err
  code=$?
  set -e
  if [ "$code" != 2 ] || [ "$(wc -l < bad.err)" != 1 ]; then echo "expected one error line and exit 2 for: $bad (got $code)"; cat bad.err; exit 1; fi
done
echo "4. --eval-only --quantize int8 / int8-static: $(grep '^  int8 ' q.out | awk '{print "int8 loss", $2}') vs $(grep '^  fp32 ' q.out | awk '{print "fp32", $2}'); bad flags are one-line errors"
