#!/usr/bin/env bash
# train_gpt --dist end to end under mpiexec (tiny GPT on the fortunes corpus; Note [data parallelism in the
# trainer]):
#  1. DDP on 2 ranks x --batch 4 logs the losses of one process with --batch 8 (fp32), within 1e-6 relative;
#  2. a ZeRO-2 run on 2 ranks x --batch 6 saves a consolidated checkpoint at step 6; it resumes on 1 rank
#     (--batch 12, no --dist) and on 3 ranks (ZeRO-1, --batch 4), and both log the uninterrupted run's losses
#     for steps 7-12; --device-boundary on DDP and ZeRO-2 logs the host boundary's losses bit for bit;
#  3. --tp 2 --pp 2 on 4 ranks logs one process's losses; its checkpoint resumes alone, on 2 data-parallel
#     ranks and on --tp 2 with the same losses; --tp 2 --dist zero1 on 4 ranks too, and its checkpoint resumes
#     alone; --sequence-parallel on --tp 2 --pp 2 (with dropout) and on --tp 2 --dist zero2 logs the one
#     process's losses, and the first one's checkpoint resumes alone; --compile on tp 2 x pp 2 logs the eager
#     grid's losses bit for bit; bad grids stop before any work; --plan and --memory-budget on the grid;
#  4. ranks started with different settings stop at start-up naming the difference; ranks started without
#     --dist are told to pass it; a rank killed mid-run ends the run with a non-zero exit within a minute.
#   tests/dist/trainer_dist.sh build/release/examples/gpt/train_gpt /tmp/work mpiexec
set -euo pipefail
T=$1
W=$2
MPI=${3:-mpiexec}
rm -rf "$W" && mkdir -p "$W" && cd "$W"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ ! -d /usr/share/games/fortunes ]; then echo "SKIP: no fortunes corpus (package fortunes)"; exit 77; fi
command -v "$MPI" >/dev/null || { echo "SKIP: no $MPI (package openmpi-bin)"; exit 77; }
C=(--warmup 2 --seq 32 --eval-every 0 --eval-batches 2 --sample-tokens 8 --threads 1 --lr 1e-3)
run() { timeout 300 "$MPI" --oversubscribe "$@"; }

# Compares the losses of two logs over the steps both have from $3 on: relative difference at most $4.
same_losses() {
  /usr/bin/python3 - "$@" <<'EOF'
import json, sys
a, b, first, tol = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
def losses(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p)) if r["step"] >= first}
la, lb = losses(a), losses(b)
steps = sorted(set(la) & set(lb))
assert steps and steps[0] == first, (a, b, steps)
worst = max(abs(la[s] - lb[s]) / abs(lb[s]) for s in steps)
print(f"{a} vs {b}, steps {steps[0]}-{steps[-1]}: worst relative loss difference {worst:.2e} (tolerance {tol:g})")
sys.exit(0 if worst <= tol else 1)
EOF
}

# 1. DDP on 2 ranks = one process on the global batch.
"$T" "${C[@]}" --steps 10 --batch 8 --log one.jsonl > one.out
run -np 2 "$T" "${C[@]}" --steps 10 --batch 4 --dist ddp --bucket-mb 0.25 --log ddp.jsonl > ddp.out
grep -q "data parallel: ddp over 2 ranks (mpi)" ddp.out
grep -q "2 ranks, comm wait" ddp.out
grep -q "communication     2 ranks (ddp)" ddp.out
same_losses ddp.jsonl one.jsonl 1 1e-6

# 2. A consolidated ZeRO-2 checkpoint resumes on 1 rank and on 3 ranks.
run -np 2 "$T" "${C[@]}" --steps 12 --batch 6 --dist zero2 --bucket-mb 0.25 --save-dir ck --save-every 6 --keep 0 --log zero2.jsonl > zero2.out
test -f ck/ckpt-00000006.safetensors
"$T" "${C[@]}" --steps 12 --batch 12 --resume ck/ckpt-00000006.safetensors --log alone.jsonl > alone.out
grep -q "resumed from ck/ckpt-00000006.safetensors at step 6" alone.out
if grep -q "resuming with a different setting" alone.out; then echo "FAIL: the 1-rank resume saw other settings"; cat alone.out; exit 1; fi
run -np 3 "$T" "${C[@]}" --steps 12 --batch 4 --dist zero1 --resume ck/ckpt-00000006.safetensors --log three.jsonl > three.out
same_losses alone.jsonl zero2.jsonl 7 1e-6
same_losses three.jsonl zero2.jsonl 7 1e-6

# 2b. --device-boundary with --dist (Note [the device boundary across ranks]): the ranks sum their losses, overflow
#     flags and (ZeRO) squared norms on the device; the host boundary's losses bit for bit, DDP and ZeRO-2.
run -np 2 "$T" "${C[@]}" --steps 10 --batch 4 --dist ddp --bucket-mb 0.25 --device-boundary --log ddp_dev.jsonl > ddp_dev.out
grep -q "step boundary on the device" ddp_dev.out
same_losses ddp_dev.jsonl ddp.jsonl 1 0
run -np 2 "$T" "${C[@]}" --steps 12 --batch 6 --dist zero2 --bucket-mb 0.25 --device-boundary --log zero2_dev.jsonl > zero2_dev.out
same_losses zero2_dev.jsonl zero2.jsonl 1 0

# 3. A process grid (Note [model parallelism in the trainer]): tp 2 x pp 2 on 4 ranks logs the one process's
#    losses; its checkpoint (one-process layout) resumes alone and on 2 data-parallel ranks with the same losses.
G=(--steps 10 --batch 4 --grad-accum 2)
"$T" "${C[@]}" "${G[@]}" --log g_one.jsonl > g_one.out
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --save-dir gck --save-every 5 --keep 0 --log grid.jsonl > grid.out
grep -q "grid: dp 1 x pp 2 x tp 2 = 4 ranks (mpi)" grid.out
grep -q "pipeline bubble: (p-1)/(m+p-1) = 0.333" grid.out
same_losses grid.jsonl g_one.jsonl 1 1e-6
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --checkpoint blocks --log grid_ckpt.jsonl > grid_ckpt.out
grep -q "activation checkpointing: blocks" grid_ckpt.out
same_losses grid_ckpt.jsonl g_one.jsonl 1 1e-6
# --compile on the grid (Note [compiled steps in the trainer]): every rank replays its step; the eager grid's losses,
# bit for bit, with the fusion rewrite (the tensor-parallel blocks' bias and residual adds are chains: fused
# fp32 adds change no bit) and without it.
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --compile --log grid_comp.jsonl > grid_comp.out
grep -q "compile           2 capture(s), 8 replays, [1-9][0-9]* fused chains, [0-9]* fused pairs on rank 0" grid_comp.out
same_losses grid_comp.jsonl grid.jsonl 1 0
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --compile --no-fuse --log grid_nofuse.jsonl > grid_nofuse.out
grep -q "compile           1 capture(s), 9 replays, 0 fused chains, 0 fused pairs on rank 0" grid_nofuse.out
same_losses grid_nofuse.jsonl grid.jsonl 1 0
"$T" "${C[@]}" --steps 10 --batch 4 --grad-accum 2 --resume gck/ckpt-00000005.safetensors --log g_alone.jsonl > g_alone.out
run -np 2 "$T" "${C[@]}" --steps 10 --batch 2 --grad-accum 2 --dist ddp --resume gck/ckpt-00000005.safetensors --log g_dp.jsonl > g_dp.out
run -np 2 "$T" "${C[@]}" --steps 10 --batch 4 --grad-accum 2 --tp 2 --resume gck/ckpt-00000005.safetensors --log g_tp.jsonl > g_tp.out
same_losses g_alone.jsonl g_one.jsonl 6 1e-6
same_losses g_dp.jsonl g_one.jsonl 6 1e-6
same_losses g_tp.jsonl g_one.jsonl 6 1e-6
# The small preset in bf16 on the same grid: the one process's losses within bf16's rounding.
"$T" "${C[@]}" --model small --steps 4 --batch 4 --grad-accum 2 --precision bf16 --log s_one.jsonl > s_one.out
run -np 4 "$T" "${C[@]}" --model small --steps 4 --batch 4 --grad-accum 2 --precision bf16 --tp 2 --pp 2 --log s_grid.jsonl > s_grid.out
same_losses s_grid.jsonl s_one.jsonl 1 1e-2
# ZeRO-1 over the replicas of a tensor-parallel model (dp 2 x tp 2): the one process's losses, and its consolidated
# checkpoint resumes alone.
run -np 4 "$T" "${C[@]}" --steps 10 --batch 2 --grad-accum 2 --tp 2 --dist zero1 --save-dir zck --save-every 5 --keep 0 --log g_zero.jsonl > g_zero.out
grep -q "grid: dp 2 x pp 1 x tp 2 = 4 ranks (mpi).*replicas: zero1" g_zero.out
same_losses g_zero.jsonl g_one.jsonl 1 1e-6
"$T" "${C[@]}" --steps 10 --batch 4 --grad-accum 2 --resume zck/ckpt-00000005.safetensors --log g_zalone.jsonl > g_zalone.out
same_losses g_zalone.jsonl g_one.jsonl 6 1e-6
# ZeRO-2 over the replicas of a pipeline (dp 2 x pp 2).
run -np 4 "$T" "${C[@]}" --steps 10 --batch 2 --grad-accum 2 --pp 2 --dist zero2 --log g_zpp.jsonl > g_zpp.out
same_losses g_zpp.jsonl g_one.jsonl 1 1e-6
# Sequence parallelism (Note [sequence parallelism]): with dropout, the one process's losses on tp 2 x pp 2
# (the pipeline draws the one process's numbers, Note [pipeline parallelism]), and its checkpoint resumes
# alone with them; under ZeRO-2 over dp 2 x tp 2.
"$T" "${C[@]}" "${G[@]}" --dropout 0.1 --log sp_one.jsonl > sp_one.out
run -np 4 "$T" "${C[@]}" "${G[@]}" --dropout 0.1 --tp 2 --pp 2 --sequence-parallel --save-dir spck --save-every 5 --keep 0 --log sp_grid.jsonl > sp_grid.out
grep -q "sequence parallelism" sp_grid.out
same_losses sp_grid.jsonl sp_one.jsonl 1 1e-6
# (without dropout: data-parallel replicas draw each their own rows' numbers, not the one process's)
run -np 4 "$T" "${C[@]}" --steps 10 --batch 2 --grad-accum 2 --tp 2 --sequence-parallel --dist zero2 --log sp_zero.jsonl > sp_zero.out
same_losses sp_zero.jsonl g_one.jsonl 1 1e-6
"$T" "${C[@]}" "${G[@]}" --dropout 0.1 --resume spck/ckpt-00000005.safetensors --log sp_alone.jsonl > sp_alone.out
same_losses sp_alone.jsonl sp_one.jsonl 6 1e-6
for bad in "--sequence-parallel" "--tp 2 --sequence-parallel"; do
  if "$T" "${C[@]/#32/33}" --steps 4 $bad > bad.out 2>&1; then echo "FAIL: train_gpt $bad trained"; exit 1; fi
  grep -q "it needs --tp 2 or more\|--seq 33 is not a multiple of --tp 2" bad.out || { cat bad.out; exit 1; }
done
for bad in "--tp 3" "--pp 5"; do
  if "$T" "${C[@]}" --steps 4 $bad > bad.out 2>&1; then echo "FAIL: train_gpt $bad trained"; exit 1; fi
  grep -q "do not split over 3 ranks\|more pipeline stages than the model's 4 blocks" bad.out || { cat bad.out; exit 1; }
done
set +e
run -np 3 "$T" "${C[@]}" --steps 4 --batch 4 --tp 2 > bad3.out 2>&1
rc=$?
set -e
[ $rc -ne 0 ] && grep -q "does not divide the 3 ranks started" bad3.out || { echo "FAIL: --tp 2 on 3 ranks"; cat bad3.out; exit 1; }
# --plan and --memory-budget on the grid: every rank captures its own step, the largest peak over the ranks
# decides; --plan writes nothing, a budget that fits trains the eager grid's losses bit for bit, and one that
# nothing fits stops every rank before step 1.
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --plan --log gplan.jsonl --save-dir gplan_ck > gplan.out
grep -q "memory plan of one step (--checkpoint none, rank 0):" gplan.out || { cat gplan.out; exit 1; }
grep -q "activations kept for backward" gplan.out
grep -q "largest planned peak over the ranks: .* on rank [0-3] of 4" gplan.out || { cat gplan.out; exit 1; }
[ ! -e gplan.jsonl ] && [ ! -e gplan_ck ] || { echo "FAIL: --plan on the grid wrote a log or a checkpoint"; exit 1; }
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --memory-budget 4G --log gbudget.jsonl > gbudget.out
grep -q "memory budget 4.00 GiB: planned peaks none .* on rank [0-3] of 4: training with --checkpoint none" gbudget.out || { cat gbudget.out; exit 1; }
same_losses gbudget.jsonl grid.jsonl 1 0
set +e
run -np 4 "$T" "${C[@]}" "${G[@]}" --tp 2 --pp 2 --memory-budget 64K --log gsmall.jsonl > gsmall.out 2>&1
rc=$?
set -e
[ $rc -ne 0 ] && grep -q "no activation checkpointing fits it; the smallest planned peak is .* on rank [0-3] of 4 (--checkpoint [a-z]*)" gsmall.out ||
  { echo "FAIL: a grid --memory-budget that nothing fits"; cat gsmall.out; exit 1; }
[ ! -e gsmall.jsonl ] || { echo "FAIL: the grid trained past a budget that nothing fits"; exit 1; }

# 4. Errors.
set +e
run -np 1 "$T" "${C[@]}" --steps 4 --batch 4 --dist ddp : -np 1 "$T" "${C[@]}" --steps 4 --batch 4 --dist ddp --weight-decay 0.05 > mismatch.out 2>&1
rc=$?
set -e
[ $rc -ne 0 ] || { echo "FAIL: ranks with different --weight-decay trained"; cat mismatch.out; exit 1; }
grep -q 'was started with other settings than rank 0 (weight_decay: rank 0 ' mismatch.out || { cat mismatch.out; exit 1; }

set +e
run -np 2 "$T" "${C[@]}" --steps 4 --batch 4 > nodist.out 2>&1
rc=$?
set -e
[ $rc -ne 0 ] && grep -q "pass --dist ddp, zero1 or zero2" nodist.out || { echo "FAIL: 2 ranks without --dist"; cat nodist.out; exit 1; }

# A rank killed mid-run: the launcher and the survivors end (non-zero) instead of waiting forever.
run -np 2 "$T" "${C[@]}" --steps 100000 --batch 4 --dist ddp --dist-timeout 30 --log killed.jsonl > killed.out 2>&1 &
launcher=$!
for _ in $(seq 1 600); do
  [ -s killed.jsonl ] && [ "$(wc -l < killed.jsonl)" -ge 3 ] && break
  sleep 0.1
done
victim=$(pgrep -f -- "--log killed.jsonl" | while read -r p; do [ "$(cat /proc/$p/comm)" = "train_gpt" ] && echo "$p"; done | tail -1)
[ -n "$victim" ] || { echo "FAIL: no rank to kill"; cat killed.out; exit 1; }
kill -9 "$victim"
start=$SECONDS
set +e
wait $launcher
rc=$?
set -e
[ $rc -ne 0 ] || { echo "FAIL: the run with a killed rank exited 0"; exit 1; }
[ $((SECONDS - start)) -le 60 ] || { echo "FAIL: the survivors took $((SECONDS - start)) s to end"; exit 1; }
echo "a killed rank ended the run in $((SECONDS - start)) s (exit $rc):"
grep -m3 -i "rank\|killed\|signal" killed.out || true
echo "trainer_dist: OK"
