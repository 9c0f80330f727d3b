#!/usr/bin/env bash
# The trainer against hostile input and lost output (issue 28; Note [the trainer's guards] in
# examples/gpt/guards.hpp, Note [runs own their checkpoints] in include/typegrad/io/train_state.hpp).
# One case per run, each a CTest of its own (tests/CMakeLists.txt):
#   tests/trainer/reliability.sh CASE build/release/examples/gpt/train_gpt WORKDIR
# CASE: shared_save_dir | bad_flags | nonfinite_weights | nonfinite_loss | log_write_failure | log_resume |
#       save_dir_unwritable | checkpoint_fields | stale_temporaries | resume_fallback | header_flush | plot
# Every failure of the trainer must be a one-line "train_gpt: error: ..." on stderr with exit code 2 (3 for a
# non-finite step), never a signal or a hang; each check names what it expected.
set -uo pipefail
CASE=$1
T=$2
W=$3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TOOL="/usr/bin/python3 $HERE/ckpt_tool.py"
rm -rf "$W" && mkdir -p "$W" && cd "$W" || exit 1
export OMP_NUM_THREADS=1
if [ ! -d /usr/share/games/fortunes ]; then echo "SKIP: no fortunes corpus (package fortunes)"; exit 77; fi
Q=(--warmup 0 --batch 2 --seq 16 --eval-every 0 --eval-batches 1 --sample-tokens 4)

fail() { echo "FAIL [$CASE]: $*"; exit 1; }
# run NAME ARGS...: runs the trainer with a 120 s timeout, stdout to NAME.out and stderr to NAME.err; sets rc.
run() {
  local name=$1
  shift
  timeout 120 "$T" "$@" >"$name.out" 2>"$name.err"
  rc=$?
  [ $rc -ne 124 ] || fail "$name: the trainer hung (killed after 120 s)"
  [ $rc -lt 128 ] || fail "$name: the trainer died by signal $((rc - 128)): $(tail -3 "$name.err")"
}
# expect_error NAME RC REGEX ARGS...: the run fails with exit code RC and one stderr line matching REGEX.
expect_error() {
  local name=$1 want=$2 re=$3
  shift 3
  run "$name" "$@"
  [ $rc -eq "$want" ] || fail "$name: exit code $rc, expected $want; stderr: $(cat "$name.err")"
  grep -v '^$' "$name.err" | grep -qE "^train_gpt: error: .*$re" || fail "$name: stderr does not match /$re/: $(cat "$name.err")"
  [ "$(grep -vc '^$' "$name.err")" = 1 ] || fail "$name: the error is not one line: $(cat "$name.err")"
  echo "  $name: exit $rc: $(grep -v '^$' "$name.err" | cut -c1-220)"
}
expect_ok() {
  local name=$1
  shift
  run "$name" "$@"
  [ $rc -eq 0 ] || fail "$name: exit code $rc, expected 0; stderr: $(cat "$name.err")"
}
ckpts() { ls "$1" | grep -E '^ckpt-[0-9]+\.safetensors$' | tr '\n' ' '; }

case "$CASE" in
shared_save_dir)
  # An older run left ckpt-4/8/12 in S; a fresh run must neither delete them nor be resumed by mistake.
  expect_ok old --steps 12 "${Q[@]}" --save-dir S --save-every 4 --keep 0
  old_id=$(grep -o 'run [0-9a-f]\{16\}' old.out | head -1 | cut -d' ' -f2)
  [ -n "$old_id" ] || fail "the first run printed no run id"
  before=$(ckpts S)
  expect_error fresh 2 "--save-dir: 'S' holds checkpoints of another run \(S/ckpt-00000004.safetensors, S/ckpt-00000008.safetensors, S/ckpt-00000012.safetensors\).*--share-save-dir" \
    --steps 3 "${Q[@]}" --save-dir S --save-every 1 --keep 3
  [ "$(ckpts S)" = "$before" ] || fail "the refused run changed the directory: $(ckpts S)"
  grep -q "^step" fresh.out && fail "the refused run trained"
  # Shared on request: the new run keeps its own newest 2 and deletes nothing of the old run's.
  expect_ok shared --steps 3 "${Q[@]}" --save-dir S --save-every 1 --keep 2 --share-save-dir
  [ "$(ckpts S)" = "ckpt-00000002.safetensors ckpt-00000003.safetensors ckpt-00000004.safetensors ckpt-00000008.safetensors ckpt-00000012.safetensors " ] \
    || fail "after the shared run the directory holds: $(ckpts S)"
  # A run that would save onto another run's step is refused before training.
  expect_error collide 2 "this run would save step 4 where another run's checkpoint is \(S/ckpt-00000004.safetensors\)" \
    --steps 4 "${Q[@]}" --save-dir S --save-every 4 --share-save-dir
  # --resume DIR says which run and step it picked, and that other runs are there.
  expect_ok resume --steps 12 "${Q[@]}" --resume S
  grep -q "^resumed from S/ckpt-00000012.safetensors at step 12 of 12 (run $old_id)$" resume.out || fail "resume did not name run and step: $(cat resume.out)"
  grep -q "^note: S also holds 2 checkpoint(s) of other runs" resume.out || fail "resume did not mention the other run: $(cat resume.out)"
  grep -q "nothing left to train" resume.out || fail "resume at the last step did not say so"
  echo "OK shared_save_dir: refused without --share-save-dir, nothing of the old run deleted with it, collisions refused, resume names run $old_id"
  ;;

bad_flags)
  # Q without the sizes: each case sets its own.
  Q2=(--eval-every 0 --eval-batches 1 --sample-tokens 4)
  bad2() {
    local n=$1 re=$2
    shift 2
    local steps=(--steps 3)
    [[ " $* " == *" --steps "* ]] && steps=()
    expect_error "$n" 2 "$re" "${steps[@]}" "${Q2[@]}" "$@"
    [ ! -s "$n.out" ] || fail "$n: work started: $(head -2 "$n.out")"
  }
  bad2 threads "--threads must be from 0 .* got 100000" --threads 100000
  bad2 batch_max "--batch must be at most 2147483648, got 9223372036854775807" --batch 9223372036854775807
  bad2 batch_zero "--batch must be a positive integer, got 0" --batch 0
  bad2 batch_neg "--batch must be a positive integer, got -4" --batch -4
  bad2 product "--batch x --seq must be at most 2147483648 tokens per micro-batch, got 1000000 x 1000000" --batch 1000000 --seq 1000000
  bad2 overflow "the run's token count .* overflows a 64-bit integer" --batch 1000000 --seq 1024 --grad-accum 1000000 --steps 1099511627776
  bad2 memory "the run needs at least .* GiB of memory .*--batch 1000000 x --seq 1024.*lower --batch or --seq" --batch 1000000 --seq 1024
  bad2 memory_mid "the run needs at least .* GiB of memory" --batch 100000
  bad2 steps_zero "--steps must be a positive integer, got 0" --steps 0
  bad2 min_lr "--min-lr \(0.1\) must not exceed --lr \(0.01\)" --lr 0.01 --min-lr 0.1
  bad2 min_lr_neg "--min-lr must be a non-negative number, got -1" --min-lr -1
  bad2 seed_neg "--seed must be an integer from 0 to 18446744073709551615, got '-1'" --seed -1
  bad2 seed_big "--seed must be an integer from 0 to 18446744073709551615, got '18446744073709551616'" --seed 18446744073709551616
  bad2 lr_text "--lr" --lr abc
  bad2 lr_zero "--lr must be a positive number, got 0" --lr 0
  bad2 lr_inf "--lr must be a positive number, got inf" --lr inf
  bad2 dropout "--dropout must be in \[0, 1\), got 1" --dropout 1
  bad2 val_fraction "--val-fraction must be in \[0.001, 0.5\], got 0" --val-fraction 0
  bad2 warmup "--warmup must be from 0 to below --steps \(3\), got 5" --warmup 5
  bad2 keep "--keep must be a non-negative integer, got -1" --keep -1
  bad2 unknown_flag "not expected: .*--bogus" --bogus 3
  bad2 model "--model" --model huge
  grep -q "Value 0 not in range\|17976931348623157" ./*.err && fail "a CLI11 range message with DBL_MAX is back"
  echo "OK bad_flags: every bad value is one line naming the flag, exit 2, before any work"
  ;;

nonfinite_weights)
  expect_ok src --steps 2 "${Q[@]}" --save-dir S
  name=$($TOOL weights-nan S/ckpt-00000002.safetensors nan.safetensors nan)
  $TOOL weights-nan S/ckpt-00000002.safetensors inf.safetensors inf >/dev/null
  $TOOL weights-nan S/ckpt-00000002.safetensors fine.safetensors 0.5 >/dev/null
  expect_ok control --steps 2 "${Q[@]}" --init-from fine.safetensors
  expect_error nan 2 "--init-from: load_weights: nan.safetensors: tensor '$name' holds 1 non-finite value \(the first, at flat index 1, is nan\); nothing was loaded \(--allow-nonfinite-weights loads it anyway\)" \
    --steps 2 "${Q[@]}" --init-from nan.safetensors
  expect_error inf 2 "tensor '$name' holds 1 non-finite value \(the first, at flat index 1, is inf\)" --steps 2 "${Q[@]}" --init-from inf.safetensors
  # Asked for, the poison loads, and the first step's NaN loss then stops the run (exit 3).
  expect_error allowed 3 "step 1: the loss is nan; no update was applied; training stopped" \
    --steps 2 "${Q[@]}" --init-from nan.safetensors --allow-nonfinite-weights
  grep -q "^initialized the weights from nan.safetensors" allowed.out || fail "--allow-nonfinite-weights did not load"
  echo "OK nonfinite_weights: NaN and inf weights are refused naming '$name'; allowed on request"
  ;;

nonfinite_loss)
  # --lr 1e30: the first update is finite but absurd, the next loss is not; the run stops before applying it.
  expect_error stop 3 "step [0-9]+: the (loss|global gradient norm) is [-a-z]+; no update was applied; training stopped, nothing was saved after step [0-9]+ \(the newest checkpoint is D/ckpt-[0-9]+.safetensors\)\. Lower --lr, or pass --on-nonfinite skip" \
    --steps 8 "${Q[@]}" --lr 1e30 --save-dir D --save-every 1 --keep 0 --log stop.jsonl
  bad_step=$(grep -oE "step [0-9]+:" stop.err | grep -oE "[0-9]+")
  newest=$(ckpts D | tr ' ' '\n' | grep . | tail -1)
  [ "$newest" = "$(printf 'ckpt-%08d.safetensors' $((bad_step - 1)))" ] || fail "the newest checkpoint is $newest, expected step $((bad_step - 1))"
  # The newest checkpoint is finite: it passes the non-finite check on loading (its absurd weights then stop
  # the first step of a run that starts from them, as they should).
  expect_error reload 3 "step 1: the loss is" --steps 2 "${Q[@]}" --init-from "D/$newest"
  grep -q "^initialized the weights from D/$newest" reload.out || fail "the newest checkpoint did not load: $(cat reload.err)"
  [ "$(wc -l < stop.jsonl)" = $((bad_step - 1)) ] || fail "the log has $(wc -l < stop.jsonl) lines, expected $((bad_step - 1))"
  # --on-nonfinite skip: the run finishes, counting the skipped steps.
  expect_ok skip --steps 6 "${Q[@]}" --lr 1e30 --on-nonfinite skip --log skip.jsonl
  grep -qE "skipped [0-9]+ \(non-finite\)" skip.out || fail "the progress line does not count skipped steps: $(grep '^step' skip.out | tail -1)"
  tail -1 skip.jsonl | grep -qE '"skipped_steps":[1-9]' || fail "the log does not count skipped steps: $(tail -1 skip.jsonl)"
  echo "OK nonfinite_loss: stopped at step $bad_step with $newest the newest checkpoint (finite); skip mode finishes: $(grep -oE 'skipped [0-9]+ \(non-finite\)' skip.out | tail -1)"
  ;;

log_write_failure)
  expect_error devfull 2 "--log: writing '/dev/full' failed at step 1: No space left on device \(--log-errors warn keeps training without the log\)" \
    --steps 3 "${Q[@]}" --log /dev/full
  expect_ok warn --steps 3 "${Q[@]}" --log /dev/full --log-errors warn
  grep -q "warning: --log: writing '/dev/full' failed at step 1: No space left on device; the log ends here" warn.err || fail "no warning: $(cat warn.err)"
  # A full tmpfs of 64 KiB: the log fills it mid-run.
  mkdir -p small
  if mount -t tmpfs -o size=64k tmpfs small 2>/dev/null; then
    head -c 60000 /dev/zero > small/filler
    expect_error tmpfs 2 "--log: writing 'small/run.jsonl' failed at step [0-9]+: No space left on device" \
      --steps 200 "${Q[@]}" --log small/run.jsonl
    umount small
    echo "OK log_write_failure: /dev/full and a full tmpfs stop the run with exit 2; --log-errors warn trains on"
  else
    echo "OK log_write_failure: /dev/full stops the run with exit 2; --log-errors warn trains on (tmpfs case skipped: mount is not permitted here)"
  fi
  ;;

log_resume)
  expect_ok full --steps 6 "${Q[@]}" --save-dir D --save-every 3 --keep 0 --log run.jsonl
  cp run.jsonl full.jsonl
  # The interrupted run's log went past its last checkpoint (steps 4-6 after ckpt 3): resume from ckpt 3.
  expect_ok resumed --steps 6 "${Q[@]}" --resume D/ckpt-00000003.safetensors --log run.jsonl
  steps=$(sed -n 's/^{"step":\([0-9]*\),.*/\1/p' run.jsonl | tr '\n' ' ')
  [ "$steps" = "1 2 3 4 5 6 " ] || fail "the continued log holds steps: $steps"
  losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([^,]*\),.*/\1 \2/p' "$1"; }
  diff <(losses full.jsonl) <(losses run.jsonl) >/dev/null || fail "the continued log's losses differ from the uninterrupted run's"
  echo "OK log_resume: the resumed run kept steps 1-3 of its log and appended 4-6 (losses identical to the uninterrupted run)"
  ;;

save_dir_unwritable)
  echo x > afile
  expect_error regular 2 "checkpoint: 'afile' exists and is not a directory" --steps 3 "${Q[@]}" --save-dir afile
  expect_error procdir 2 "checkpoint: cannot write into directory '/proc/self/fdinfo'" --steps 3 "${Q[@]}" --save-dir /proc/self/fdinfo
  expect_error nested 2 "checkpoint: cannot create directory 'afile/sub'" --steps 3 "${Q[@]}" --save-dir afile/sub
  for n in regular procdir nested; do [ ! -s $n.out ] || fail "$n: work started before the check: $(head -1 $n.out)"; done
  echo "OK save_dir_unwritable: a regular file, an unwritable directory and an impossible path fail before step 1"
  ;;

checkpoint_fields)
  expect_ok base --steps 6 "${Q[@]}" --save-dir D --save-every 3 --keep 0
  C=D/ckpt-00000003.safetensors
  $TOOL edit-state $C same.safetensors 'step=3'  # the tool's rewrite alone must still resume
  expect_ok same --steps 6 "${Q[@]}" --resume same.safetensors
  edit() { local n=$1 re=$2; shift 2; $TOOL edit-state $C $n.safetensors "$@"; expect_error "$n" 2 "$re" --steps 6 "${Q[@]}" --resume $n.safetensors; }
  edit step_huge "the checkpoint is at step 1000000000000000, beyond --steps 6" 'step=1000000000000000'
  edit tokens_huge "state field 'tokens_done' must be a whole number from 0 to 2\^53, got 1e\+300" 'scalars.tokens_done=1e300'
  edit tokens_wrong "state field 'tokens_done' is 5, but 3 steps of 32 tokens make 96" 'scalars.tokens_done=5'
  edit sampler_max "the sampler has drawn 18446744073709551615 batches, but 3 steps of 1 micro-batches draw 3" 'sampler.counter=18446744073709551615'
  edit gen_max "generator 'sample' is at offset 18446744073709551615, beyond any run's draws" 'generators.sample.offset=18446744073709551615'
  edit gen_init "generator 'init' is at offset 7, a model built from the seed draws" 'generators.init.offset=7'
  edit schedule "inconsistent counters: step 3, schedule step 2, accumulator steps 3" 'schedule_step=2'
  edit skipped "inconsistent counters: step 3 is not the 3 steps taken plus the 5 skipped" 'scalars.nonfinite_skipped=5'
  edit skipped_frac "state field 'nonfinite_skipped' must be a whole number from 0 to 2\^53, got 0.5" 'scalars.nonfinite_skipped=0.5'
  edit step_neg "state field 'step' is negative" 'step=-1'
  echo "OK checkpoint_fields: every out-of-range or inconsistent state field is refused, naming the field"
  ;;

stale_temporaries)
  expect_ok first --steps 2 "${Q[@]}" --save-dir D --save-every 1
  sleep 0.1 & dead=$!
  wait $dead
  printf partial > "D/.ckpt-00000009.safetensors.tmp-$dead-1"   # a killed save's (its process is gone)
  printf partial > "D/.ckpt-00000009.safetensors.tmp-$$-1"      # a live writer's (this shell)
  expect_ok resume --steps 3 "${Q[@]}" --save-dir D --save-every 1 --resume D
  [ ! -e "D/.ckpt-00000009.safetensors.tmp-$dead-1" ] || fail "the dead process's temporary is still there"
  [ -e "D/.ckpt-00000009.safetensors.tmp-$$-1" ] || fail "a live process's temporary was removed"
  echo "OK stale_temporaries: the next save removed the dead writer's temporary and kept the live one's"
  ;;

resume_fallback)
  expect_ok base --steps 4 "${Q[@]}" --save-dir D --save-every 1 --keep 0
  $TOOL flip-byte D/ckpt-00000004.safetensors
  expect_error damaged 2 "--resume: the newest checkpoint in 'D' is damaged: .*D/ckpt-00000004.safetensors.*\(--resume-fallback resumes from the newest intact checkpoint instead\)" \
    --steps 4 "${Q[@]}" --resume D
  expect_ok fallback --steps 4 "${Q[@]}" --resume D --resume-fallback
  grep -q "^warning: --resume-fallback: passing over the damaged D/ckpt-00000004.safetensors" fallback.out || fail "no warning: $(cat fallback.out)"
  grep -q "^resumed from D/ckpt-00000003.safetensors at step 3 of 4" fallback.out || fail "did not resume from step 3: $(cat fallback.out)"
  echo "OK resume_fallback: a damaged newest checkpoint is an error naming it; --resume-fallback resumes from step 3 with a warning"
  ;;

header_flush)
  # stdout to a file: the header must be there while the (long) step-0 evaluation still runs.
  "$T" --model small --steps 1 --warmup 0 --batch 16 --seq 128 --eval-batches 400 --sample-tokens 4 > out.txt 2> err.txt &
  pid=$!
  for _ in $(seq 1 600); do grep -q "^baseline:" out.txt && break; sleep 0.05; done
  seen=$(cat out.txt)
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
  echo "$seen" | grep -q "^baseline:" || fail "no header within 30 s of the start"
  echo "$seen" | grep -q "^step 0: val loss" && { echo "SKIP: the step-0 evaluation finished before the header was read; the case proves nothing here"; exit 77; }
  echo "OK header_flush: the header lines reached the file before the step-0 evaluation ended"
  ;;

plot)
  # --plot draws the log with matplotlib (scripts/plot_log.py); a plot that cannot be written is an error.
  /usr/bin/python3 -c "import matplotlib" 2>/dev/null || { echo "SKIP: python3-matplotlib is not installed"; exit 77; }
  PLOT="/usr/bin/python3 $HERE/../../scripts/plot_log.py"
  expect_ok png --steps 6 --warmup 0 --batch 2 --seq 16 --eval-every 3 --eval-batches 1 --sample-tokens 4 --log run.jsonl --plot run.png
  grep -q "^  plot              run.png$" png.out || fail "the summary does not say where the plot is"
  grep -q "^  log               run.jsonl$" png.out || fail "the summary does not say where the log is"
  [ "$(head -c 8 run.png | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "run.png is not a PNG"
  [ "$(stat -c %s run.png)" -gt 10000 ] || fail "run.png is too small to hold the figure"
  $PLOT run.jsonl run.svg > svg.out || fail "plot_log.py failed on the trainer's log"
  grep -q "<svg" run.svg || fail "run.svg is not an SVG"
  : > empty.jsonl
  $PLOT empty.jsonl e.png 2> e.err; [ $? -eq 2 ] && grep -q "holds no step" e.err || fail "an empty log: $(cat e.err)"
  echo '{"step":1,"loss":' > broken.jsonl
  $PLOT broken.jsonl b.png 2> b.err; [ $? -eq 2 ] && grep -q "broken.jsonl:1: not a JSON line" b.err || fail "a broken log: $(cat b.err)"
  expect_error unwritable 2 "--plot: cannot write 'nodir/run.png': No such file or directory" --steps 2 "${Q[@]}" --log run2.jsonl --plot nodir/run.png
  [ ! -s unwritable.out ] || fail "training started although the plot cannot be written"
  expect_error pdf 2 "--plot must name a .png or .svg file, got 'run.pdf'" --steps 2 "${Q[@]}" --log run3.jsonl --plot run.pdf
  expect_error nolog 2 "--plot needs --log" --steps 2 "${Q[@]}" --plot run.png
  echo "OK plot: the trainer's PNG and an SVG from its log; empty and broken logs, an unwritable plot and a bad name are errors"
  ;;

*)
  fail "unknown case"
  ;;
esac
