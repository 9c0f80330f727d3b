#!/usr/bin/env bash
# train_gpt --device cuda end to end on a GPU (skips with exit 77 without one):
#  1. fp32, bf16, fp16 (loss scaling) and tf32 (fp32 with TF32 GEMMs; the CPU runs fp32): 6 optimizer steps (2 micro-batches each, clipping, warmup + cosine, dropout off) on
#     the GPU log the CPU's losses within tolerance;
#  2. a GPU checkpoint resumes on the CPU and a CPU checkpoint on the GPU (one file format), and the
#     resumed runs continue with the uninterrupted run's losses within tolerance;
#  3. --checkpoint blocks, sampling and evaluation run on the GPU;
#  4. --optimizer sgd, lamb and adafactor on the GPU log the CPU's losses within tolerance, and a LAMB run
#     checkpointed on the GPU resumes on the CPU (and an Adafactor one the other way) with the same losses;
#  5. --device-boundary (bf16, fp16, SGD) logs the host boundary's losses on the GPU;
#  6. --dist zero2 --device-boundary at world size 1 (NCCL, DataParallel<cuda>) logs part 1's bf16 losses;
#  7. --compile --device-boundary --graph-report on the GPU logs part 5's losses and prints its graph report;
#  8. --cuda-graphs (the compiled step's replays as CUDA graphs, in chunks of 64 launches and whole) logs part 7's
#     losses bit for bit, with the boundary on the device and on the host.
#   tests/trainer/train_gpt_cuda.sh build/cuda/examples/gpt/train_gpt /tmp/work
set -euo pipefail
T=$(readlink -f "$1")
W=$2
SRC=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$W" && mkdir -p "$W" && cd "$W"
export OMP_NUM_THREADS=2
DATA=()
if [ ! -d /usr/share/games/fortunes ]; then  # a corpus that every checkout has
  cat "$SRC"/docs/*.md "$SRC"/README.md > corpus.txt
  DATA=(--data corpus.txt)
fi
if ! "$T" "${DATA[@]}" --device cuda --steps 1 --warmup 0 --batch 2 --seq 16 --eval-every 0 --eval-batches 1 --sample-tokens 4 > probe.out 2> probe.err; then
  if grep -q "no usable CUDA device" probe.err; then echo "SKIP: $(cat probe.err)"; exit 77; fi
  cat probe.err; exit 1
fi
C=("${DATA[@]}" --warmup 2 --batch 4 --seq 32 --grad-accum 2 --eval-every 3 --eval-batches 2 --sample-tokens 16 --steps 6)
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }
# close A B ATOL RTOL: the (step, loss) lines of A and B pair up and agree within ATOL + RTOL·|loss|.
close() {
  python3 - "$1" "$2" "$3" "$4" <<'PY'
import sys
a = [l.split() for l in open(sys.argv[1]) if l.strip()]
b = [l.split() for l in open(sys.argv[2]) if l.strip()]
atol, rtol = float(sys.argv[3]), float(sys.argv[4])
assert len(a) == len(b) and len(a) > 0, f"{len(a)} vs {len(b)} steps"
for (sa, la), (sb, lb) in zip(a, b):
    assert sa == sb, f"step {sa} vs {sb}"
    assert abs(float(la) - float(lb)) <= atol + rtol * abs(float(la)), f"step {sa}: loss {la} vs {lb}"
print(f"{len(a)} steps agree")
PY
}
for p in fp32 bf16 fp16 tf32; do
  "$T" "${C[@]}" --precision $p --device cpu --log cpu_$p.jsonl > cpu_$p.out
  "$T" "${C[@]}" --precision $p --device cuda --log gpu_$p.jsonl > gpu_$p.out
  grep -q "GPU: " gpu_$p.out
  losses cpu_$p.jsonl > cpu_$p.txt
  losses gpu_$p.jsonl > gpu_$p.txt
  if [ $p = fp32 ]; then close cpu_$p.txt gpu_$p.txt 1e-3 1e-2; else close cpu_$p.txt gpu_$p.txt 1e-2 3e-2; fi
done
grep -q "on the CPU this is the fp32 run" cpu_tf32.out
echo "1. fp32, bf16, fp16 and tf32: GPU losses match the CPU's"

"$T" "${C[@]}" --device cuda --save-dir gpu_ckpt --save-every 3 --keep 0 --log gpu_full.jsonl > gpu_full.out
"$T" "${C[@]}" --device cpu --resume gpu_ckpt/ckpt-00000003.safetensors --log cpu_resumed.jsonl > cpu_resumed.out
grep -q "resumed from gpu_ckpt/ckpt-00000003.safetensors at step 3" cpu_resumed.out
losses gpu_full.jsonl | sed -n '4,6p' > gpu_full_tail.txt
losses cpu_resumed.jsonl > cpu_resumed.txt
close gpu_full_tail.txt cpu_resumed.txt 1e-3 1e-2
"$T" "${C[@]}" --device cpu --save-dir cpu_ckpt --save-every 3 --keep 0 --log cpu_full.jsonl > cpu_full.out
"$T" "${C[@]}" --device cuda --resume cpu_ckpt/ckpt-00000003.safetensors --log gpu_resumed.jsonl > gpu_resumed.out
losses cpu_full.jsonl | sed -n '4,6p' > cpu_full_tail.txt
losses gpu_resumed.jsonl > gpu_resumed.txt
close cpu_full_tail.txt gpu_resumed.txt 1e-3 1e-2
"$T" "${C[@]}" --device cuda --init-from gpu_ckpt/ckpt-00000006.safetensors > gpu_init.out
grep -q "initialized the weights from" gpu_init.out
echo "2. checkpoints move between the devices"

"$T" "${C[@]}" --device cuda --checkpoint blocks --sample-every 3 --log gpu_blocks.jsonl > gpu_blocks.out
losses gpu_blocks.jsonl > gpu_blocks.txt
losses gpu_fp32.jsonl > gpu_fp32_again.txt
close gpu_fp32_again.txt gpu_blocks.txt 1e-4 1e-3
grep -q "sample at step 3" gpu_blocks.out
echo "3. --checkpoint blocks and samples"

for opt in sgd lamb adafactor; do
  "$T" "${C[@]}" --optimizer $opt --device cpu --log cpu_$opt.jsonl > cpu_$opt.out
  "$T" "${C[@]}" --optimizer $opt --device cuda --log gpu_$opt.jsonl > gpu_$opt.out
  losses cpu_$opt.jsonl > cpu_$opt.txt
  losses gpu_$opt.jsonl > gpu_$opt.txt
  close cpu_$opt.txt gpu_$opt.txt 1e-3 1e-2
done
"$T" "${C[@]}" --optimizer lamb --device cuda --save-dir lamb_ckpt --save-every 3 --keep 0 > lamb_gpu_full.out
"$T" "${C[@]}" --optimizer lamb --device cpu --resume lamb_ckpt/ckpt-00000003.safetensors --log lamb_cpu_resumed.jsonl > lamb_cpu_resumed.out
grep -q "resumed from lamb_ckpt/ckpt-00000003.safetensors at step 3" lamb_cpu_resumed.out
losses gpu_lamb.jsonl | sed -n '4,6p' > lamb_gpu_tail.txt
losses lamb_cpu_resumed.jsonl > lamb_cpu_resumed.txt
close lamb_gpu_tail.txt lamb_cpu_resumed.txt 1e-3 1e-2
"$T" "${C[@]}" --optimizer adafactor --device cpu --save-dir af_ckpt --save-every 3 --keep 0 > af_cpu_full.out
"$T" "${C[@]}" --optimizer adafactor --device cuda --resume af_ckpt/ckpt-00000003.safetensors --log af_gpu_resumed.jsonl > af_gpu_resumed.out
losses cpu_adafactor.jsonl | sed -n '4,6p' > af_cpu_tail.txt
losses af_gpu_resumed.jsonl > af_gpu_resumed.txt
close af_cpu_tail.txt af_gpu_resumed.txt 1e-3 1e-2
echo "4. sgd, lamb and adafactor on the GPU match the CPU, and their checkpoints move between the devices"

# --device-boundary (Note [the step boundary on the device]): the GPU decides each step's boundary and the losses
# are the host boundary's (bf16 with clipping, fp16 with its scaler, SGD).
for p in bf16 fp16; do
  "$T" "${C[@]}" --precision $p --device cuda --device-boundary --log gpu_boundary_$p.jsonl > gpu_boundary_$p.out
  grep -q "step boundary on the device" gpu_boundary_$p.out
  losses gpu_boundary_$p.jsonl > gpu_boundary_$p.txt
  close gpu_$p.txt gpu_boundary_$p.txt 0 0
done
"$T" "${C[@]}" --optimizer sgd --device cuda --device-boundary --log gpu_boundary_sgd.jsonl > gpu_boundary_sgd.out
losses gpu_boundary_sgd.jsonl > gpu_boundary_sgd.txt
close gpu_sgd.txt gpu_boundary_sgd.txt 0 0
echo "5. --device-boundary on the GPU logs the host boundary's losses"

# --dist at world size 1 on the GPU (Note [data parallelism in the trainer]): the NCCL communicator of one rank and
# DataParallel<cuda> (ZeRO-2's reduce-scatter runs through NCCL), with the step boundary on the device (Note [the
# device boundary across ranks]): part 1's one-process bf16 losses bit for bit.
"$T" "${C[@]}" --precision bf16 --device cuda --dist zero2 --device-boundary --log gpu_zero2_bf16.jsonl > gpu_zero2_bf16.out
grep -q "data parallel: zero2 over 1 ranks (nccl)" gpu_zero2_bf16.out
losses gpu_zero2_bf16.jsonl > gpu_zero2_bf16.txt
close gpu_bf16.txt gpu_zero2_bf16.txt 0 0
echo "6. --dist zero2 --device-boundary on one GPU (NCCL, world size 1) logs the one-process losses"

# --graph-report on the GPU (Note [graph blockers]): the CUDA launches and the uploads through staging blocks
# watched (Note [launch watch]); what a CUDA graph of the compiled step could not repeat is printed (the uploads'
# staging blocks are expected there until a graph owns its own). The losses are part 5's within bf16's tolerance
# (the compiled step runs fused pairs, e.g. the GELU in the GEMM's epilogue).
"$T" "${C[@]}" --precision bf16 --device cuda --device-boundary --compile --graph-report --log gpu_graph_bf16.jsonl > gpu_graph_bf16.out
grep -E "graph report: [0-9]+ launches per step" -A5 gpu_graph_bf16.out
losses gpu_graph_bf16.jsonl > gpu_graph_bf16.txt
close gpu_boundary_bf16.txt gpu_graph_bf16.txt 1e-2 3e-2
echo "7. --compile --graph-report on the GPU reports the step's launches and logs the same losses"

# --cuda-graphs (Note [CUDA graphs of a step]): the replays captured and launched as graphs run the same kernels.
"$T" "${C[@]}" --precision bf16 --device cuda --device-boundary --compile --cuda-graphs --log gpu_cgraph_bf16.jsonl > gpu_cgraph_bf16.out
grep -E "cuda graphs +[1-9][0-9]* steps as graphs" gpu_cgraph_bf16.out
losses gpu_cgraph_bf16.jsonl > gpu_cgraph_bf16.txt
close gpu_graph_bf16.txt gpu_cgraph_bf16.txt 0 0
"$T" "${C[@]}" --precision bf16 --device cuda --device-boundary --compile --cuda-graphs --graph-chunk 0 --log gpu_cgraph0_bf16.jsonl > gpu_cgraph0_bf16.out
losses gpu_cgraph0_bf16.jsonl > gpu_cgraph0_bf16.txt
close gpu_graph_bf16.txt gpu_cgraph0_bf16.txt 0 0
"$T" "${C[@]}" --precision bf16 --device cuda --compile --log gpu_compiled_host_bf16.jsonl > gpu_compiled_host_bf16.out
"$T" "${C[@]}" --precision bf16 --device cuda --compile --cuda-graphs --log gpu_cgraph_host_bf16.jsonl > gpu_cgraph_host_bf16.out
grep -E "cuda graphs +[1-9][0-9]* steps as graphs" gpu_cgraph_host_bf16.out
losses gpu_compiled_host_bf16.jsonl > gpu_compiled_host_bf16.txt
losses gpu_cgraph_host_bf16.jsonl > gpu_cgraph_host_bf16.txt
close gpu_compiled_host_bf16.txt gpu_cgraph_host_bf16.txt 0 0
echo "8. --cuda-graphs logs the compiled step's losses bit for bit (boundary on the device and on the host)"
