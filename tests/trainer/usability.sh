#!/usr/bin/env bash
# The trainer as a user keeps using it (issue 27): tokenizers, data sources, token files and generate.
# One case per run, each a CTest of its own (tests/CMakeLists.txt):
#   tests/trainer/usability.sh CASE build/release/examples/gpt/train_gpt build/release/examples/gpt/generate WORKDIR
# CASE: bpe | token_file | directory | data_errors | generate
# Every failure must be a one-line "<program>: error: ..." on stderr with exit code 2; each check names what
# it expected.
set -uo pipefail
CASE=$1
T=$2
G=$3
W=$4
rm -rf "$W" && mkdir -p "$W" && cd "$W" || exit 1
export OMP_NUM_THREADS=1 XDG_CACHE_HOME="$W/cache"
if [ ! -d /usr/share/games/fortunes ]; then echo "SKIP: no fortunes corpus (package fortunes)"; exit 77; fi
Q=(--warmup 0 --batch 2 --seq 16 --eval-every 0 --eval-batches 2 --sample-tokens 8)
# A 300 kB slice of the fortunes corpus keeps BPE training and tokenizing short.
find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.*' | sort | xargs cat 2>/dev/null | head -c 300000 >corpus.txt
[ "$(stat -c %s corpus.txt)" -ge 100000 ] || { echo "SKIP: the fortunes corpus holds under 100 kB"; exit 77; }

fail() { echo "FAIL [$CASE]: $*"; exit 1; }
# run NAME PROGRAM ARGS...: 120 s timeout, stdout to NAME.out and stderr to NAME.err; sets rc.
run() {
  local name=$1
  shift
  timeout 120 "$@" >"$name.out" 2>"$name.err"
  rc=$?
  [ $rc -ne 124 ] || fail "$name: hung (killed after 120 s)"
  [ $rc -lt 128 ] || fail "$name: died by signal $((rc - 128)): $(tail -3 "$name.err")"
}
expect_ok() {
  local name=$1
  shift
  run "$name" "$@"
  [ $rc -eq 0 ] || fail "$name: exit code $rc, expected 0; stderr: $(cat "$name.err")"
}
# expect_error NAME PROGRAM-NAME REGEX PROGRAM ARGS...: exit code 2 and one stderr line matching REGEX.
expect_error() {
  local name=$1 prog=$2 re=$3
  shift 3
  run "$name" "$@"
  [ $rc -eq 2 ] || fail "$name: exit code $rc, expected 2; stderr: $(cat "$name.err")"
  grep -v '^$' "$name.err" | grep -qE "^$prog: error: .*$re" || fail "$name: stderr does not match /$re/: $(cat "$name.err")"
  [ "$(grep -vc '^$' "$name.err")" = 1 ] || fail "$name: the error is not one line: $(cat "$name.err")"
  echo "  $name: exit 2: $(grep -v '^$' "$name.err" | cut -c1-200)"
}
losses() { grep -oE '^step +[0-9]+/[0-9]+ \| loss [0-9.]+' "$1" | sed 's/.*loss //' | tr '\n' ' '; }

case "$CASE" in
bpe)
  # bpe:N trains on the text, caches beside it, reports bits per byte; the second run reads the cache.
  expect_ok first "$T" --data corpus.txt --tokenizer bpe:300 --steps 10 "${Q[@]}"
  grep -qE "^bpe: byte-level BPE.* trained and cached in .*corpus.txt.bpe-300-[0-9a-f]{16}.json" first.out \
    || fail "no 'trained and cached' line: $(grep -i bpe first.out)"
  ls corpus.txt.bpe-300-*.json >/dev/null 2>&1 || fail "no cache file beside corpus.txt: $(ls)"
  grep -qE "^step 0: val loss [0-9.]+ \([0-9.]+ bpb\)" first.out || fail "step 0 reports no bits per byte: $(grep '^step 0' first.out)"
  grep -qE "^  val bits/byte +[0-9.]+ at the end" first.out || fail "the summary has no bits per byte"
  grep -qE "^baseline: a uniform guess over 300 tokens" first.out || fail "the baseline does not use the BPE's 300 tokens"
  expect_ok second "$T" --data corpus.txt --tokenizer bpe:300 --steps 10 "${Q[@]}"
  grep -qE "^bpe: .* read from .*corpus.txt.bpe-300-" second.out || fail "the second run did not read the cache: $(grep -i bpe second.out)"
  [ "$(losses first.out)" = "$(losses second.out)" ] || fail "cached tokenizer changed the run: $(losses first.out) vs $(losses second.out)"
  # A byte run's bits per byte is its loss / ln 2.
  expect_ok bytes "$T" --data corpus.txt --steps 10 "${Q[@]}"
  python3 - bytes.out <<'EOF' || fail "byte-level bits per byte is not loss / ln 2"
import math, re, sys
line = next(l for l in open(sys.argv[1]) if l.startswith("step 0: val loss"))
loss, bpb = map(float, re.match(r"step 0: val loss ([0-9.]+) \(([0-9.]+) bpb\)", line).groups())
assert abs(loss / math.log(2) - bpb) < 2e-3, (loss, bpb)
EOF
  echo "OK bpe: trained, cached beside the data, read back; bits per byte reported (byte-level: loss / ln 2)"
  ;;

token_file)
  # --data-export writes the tokens and the tokenizer; training from the file equals training from the text.
  expect_ok export "$T" --data corpus.txt --tokenizer bpe:300 --data-export corpus.bin
  grep -q "^wrote corpus.bin: [0-9]* tokens" export.out || fail "export did not report: $(cat export.out)"
  [ -s corpus.bin ] && [ -s corpus.bin.tokenizer.json ] || fail "no token file or sidecar: $(ls)"
  expect_ok from_text "$T" --data corpus.txt --tokenizer bpe:300 --steps 8 "${Q[@]}"
  expect_ok from_file "$T" --data corpus.bin --steps 8 "${Q[@]}"
  grep -q "^data: token file corpus.bin" from_file.out || fail "the token file was not read as one: $(head -3 from_file.out)"
  [ -n "$(losses from_text.out)" ] || fail "no losses printed"
  [ "$(losses from_text.out)" = "$(losses from_file.out)" ] || fail "token file and text differ: $(losses from_text.out) vs $(losses from_file.out)"
  # Ids beyond the vocabulary: the file without its sidecar, read as bytes.
  cp corpus.bin nosidecar.bin
  expect_error too_big train_gpt "token file 'nosidecar.bin'.*id [0-9]+.*vocabulary of 256" "$T" --data nosidecar.bin --steps 2 "${Q[@]}"
  expect_error bpe_needs_text train_gpt "a BPE is trained on text.*token file without a tokenizer sidecar" \
    "$T" --data nosidecar.bin --tokenizer bpe:300 --steps 2 "${Q[@]}"
  expect_error reexport train_gpt "--data-export: 'corpus.bin' is already a token file" "$T" --data corpus.bin --data-export x.bin
  expect_error other_kind train_gpt "--tokenizer byte: the token file 'corpus.bin' was written with another tokenizer" \
    "$T" --data corpus.bin --tokenizer byte --steps 2 "${Q[@]}"
  echo "OK token_file: export, same losses from the file as from the text, bad files refused"
  ;;

directory)
  mkdir -p texts && head -c 100000 corpus.txt >texts/a.txt && tail -c 100000 corpus.txt >texts/b.txt && echo hidden >texts/.hidden
  expect_ok dir "$T" --data texts --tokenizer bpe:280 --steps 4 "${Q[@]}"
  grep -q "data: directory 'texts' (2 files)" dir.out || fail "the directory was not read as 2 files: $(grep '^data' dir.out)"
  ls texts.bpe-280-*.json >/dev/null 2>&1 || fail "the BPE cache is not beside the directory: $(ls)"
  ls texts | grep -q json && fail "the BPE cache was written inside the data directory"
  echo "OK directory: read as its 2 files, the BPE cached beside it"
  ;;

data_errors)
  : >empty.txt
  mkdir -p emptydir
  expect_error empty_corpus train_gpt "empty" "$T" --data empty.txt --steps 2 "${Q[@]}"
  expect_error empty_dir train_gpt "emptydir" "$T" --data emptydir --steps 2 "${Q[@]}"
  expect_error missing_gpt2 train_gpt "/nonexistent/gpt2" "$T" --data corpus.txt --tokenizer gpt2:/nonexistent/gpt2 --steps 2 "${Q[@]}"
  expect_error bad_spec train_gpt "bpe:abc" "$T" --tokenizer bpe:abc --steps 2 "${Q[@]}"
  expect_error small_bpe train_gpt "bpe:100" "$T" --tokenizer bpe:100 --steps 2 "${Q[@]}"
  expect_error missing_data train_gpt "missing.txt" "$T" --data missing.txt --steps 2 "${Q[@]}"
  # A resumed run keeps its tokenizer; asking for another kind is an error.
  expect_ok saved "$T" --data corpus.txt --tokenizer bpe:300 --steps 2 "${Q[@]}" --save-dir S
  expect_error resume_other train_gpt "--tokenizer byte: the checkpoint being resumed was trained with another tokenizer" \
    "$T" --data corpus.txt --tokenizer byte --steps 4 "${Q[@]}" --resume S
  expect_ok resume_same "$T" --data corpus.txt --steps 4 "${Q[@]}" --resume S
  grep -q "resumed from S/ckpt-00000002.safetensors" resume_same.out || fail "did not resume: $(cat resume_same.out | head)"
  grep -q "warning: resuming with a different setting.*tokenizer" resume_same.out && fail "resuming without --tokenizer warned: $(grep warning resume_same.out)"
  echo "OK data_errors: empty corpus and directory, missing GPT-2 files and data, bad specs, another tokenizer on resume"
  ;;

generate)
  expect_ok train "$T" --data corpus.txt --tokenizer bpe:300 --steps 20 "${Q[@]}" --save-dir S
  expect_ok cached "$G" --checkpoint S --prompt "The " --tokens 60 --seed 7
  expect_ok full "$G" --checkpoint S --prompt "The " --tokens 60 --seed 7 --no-cache
  [ -s cached.out ] || fail "generate printed nothing"
  cmp -s cached.out full.out || fail "KV-cache and full-window decoding differ: $(cat cached.out) vs $(cat full.out)"
  grep -qE "^\[60 tokens in [0-9.]+ s: [0-9.]+ tokens/s; [0-9]+ positions computed\]" cached.err || fail "no tokens/s line: $(cat cached.err)"
  grep -q "byte-level BPE" cached.err || fail "generate did not use the checkpoint's BPE: $(head -1 cached.err)"
  grep -q "window 16 positions" cached.err || fail "the window is not the 16 trained positions: $(head -1 cached.err)"
  cached_pos=$(grep -oE '[0-9]+ positions computed' cached.err | cut -d' ' -f1)
  full_pos=$(grep -oE '[0-9]+ positions computed' full.err | cut -d' ' -f1)
  [ "$cached_pos" -lt "$full_pos" ] || fail "the cache computed $cached_pos positions, full-window $full_pos"
  expect_ok other_seed "$G" --checkpoint S --prompt "The " --tokens 60 --seed 8
  cmp -s cached.out other_seed.out && fail "another seed gave the same text"
  printf 'Once\nA man\n' | timeout 60 "$G" --checkpoint S --interactive --tokens 10 >inter.out 2>inter.err || fail "interactive failed: $(cat inter.err)"
  [ "$(grep -c 'tokens/s' inter.err)" = 2 ] || fail "interactive did not answer two prompts: $(cat inter.err)"
  expect_error no_ckpt generate "--checkpoint: 'missing' is neither" "$G" --checkpoint missing --tokens 5
  expect_error bad_top_p generate "top-p" "$G" --checkpoint S --top-p 0
  expect_error bad_seed generate "--seed" "$G" --checkpoint S --seed -3
  echo "OK generate: same text with and without the KV cache ($cached_pos vs $full_pos positions), tokens/s, interactive, errors"
  ;;

*)
  echo "unknown case $CASE"
  exit 2
  ;;
esac
