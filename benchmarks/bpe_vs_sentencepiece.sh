#!/usr/bin/env bash
# Our byte-level BPE trainer (train_byte_bpe, through examples/tools/tg_bpe) against SentencePiece's BPE trainer
# (Debian package `sentencepiece`: spm_train / spm_encode / spm_decode) on the fortunes corpus: train on the first
# 90% of its bytes with a vocabulary of N (default 2048), then on the last 10% report the training seconds, bytes
# per token (higher = better compression), encode speed and whether decode(encode(x)) == x exactly.
# SentencePiece runs as losslessly as it can (no normalization, no dummy prefix, whitespace kept, byte fallback,
# full character coverage; the exact options are printed). It reads its input as lines: the newlines themselves
# are not encoded, so each newline of the validation text is counted as one token (the <0x0A> byte piece it
# would need) and decode output is compared line by line joined with newlines. Results: docs/tokenizers.md.
#   bash benchmarks/bpe_vs_sentencepiece.sh build/release/examples/tools/tg_bpe [N=2048] [ROUNDS=3]
set -euo pipefail
TG_BPE=${1:-build/release/examples/tools/tg_bpe}
N=${2:-2048}
ROUNDS=${3:-3}
if [ ! -x "$TG_BPE" ]; then
  echo "bpe_vs_sentencepiece.sh: '$TG_BPE' is not an executable; build the target tg_bpe (examples/tools) and pass its path" >&2
  exit 2
fi
TG_BPE=$(realpath "$TG_BPE")
for tool in spm_train spm_encode spm_decode; do
  if ! command -v "$tool" > /dev/null; then
    echo "bpe_vs_sentencepiece.sh: '$tool' not found; it comes with the Debian package 'sentencepiece' (apt-get install sentencepiece)" >&2
    exit 1
  fi
done
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cd "$W"

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'; }
# best_of TIMES...: the smallest
best_of() { printf '%s\n' "$@" | sort -g | head -1; }

"$TG_BPE" corpus corpus.txt > /dev/null
BYTES=$(stat -c %s corpus.txt)
CUT=$((BYTES * 9 / 10))
head -c "$CUT" corpus.txt > train.txt
tail -c +"$((CUT + 1))" corpus.txt > val.txt
VAL_BYTES=$(stat -c %s val.txt)
VAL_LINES=$(wc -l < val.txt)

SPM_OPTS=(--model_type=bpe --vocab_size="$N" --byte_fallback=true --character_coverage=1.0
          --normalization_rule_name=identity --split_digits=false --add_dummy_prefix=false
          --remove_extra_whitespaces=false --num_threads="$(nproc)" --minloglevel=2)

ours_train=() spm_train_t=() ours_enc=() spm_enc=()
for r in $(seq 1 "$ROUNDS"); do
  s=$(now); "$TG_BPE" train train.txt "$N" ours.json > ours_train.out; e=$(now); ours_train+=("$(elapsed "$s" "$e")")
  s=$(now); spm_train --input=train.txt --model_prefix=spm "${SPM_OPTS[@]}" > spm_train.out 2>&1; e=$(now)
  spm_train_t+=("$(elapsed "$s" "$e")")
  s=$(now); "$TG_BPE" encode ours.json val.txt > ours_encode.out; e=$(now); ours_enc+=("$(elapsed "$s" "$e")")
  s=$(now); spm_encode --model=spm.model --output_format=id < val.txt > val.ids; e=$(now); spm_enc+=("$(elapsed "$s" "$e")")
done

# Ours: tokens and round trip from tg_bpe (exit status 1 when the round trip differs).
OURS_TOKENS=$(awk '$1 == "tokens" { print $2 }' ours_encode.out)
OURS_RT=$(awk '$1 == "round_trip" { print $2 }' ours_encode.out)
OURS_VOCAB=$(awk '/^tokenizer/ { sub(/^tokenizer /, ""); print }' ours_encode.out)
# SentencePiece: one id per piece, one line per input line; each newline counted as one token.
SPM_IDS=$(wc -w < val.ids)
SPM_TOKENS=$((SPM_IDS + VAL_LINES))
spm_decode --model=spm.model --input_format=id < val.ids > val.dec
if cmp -s val.dec val.txt; then SPM_RT=exact; else
  SPM_RT="DIFFERS ($(cmp val.dec val.txt 2>&1 | head -1 | sed 's/^val.dec val.txt //'))"
fi
SPM_VOCAB=$(wc -l < spm.vocab)

OT=$(best_of "${ours_train[@]}") ST=$(best_of "${spm_train_t[@]}")
OE=$(best_of "${ours_enc[@]}") SE=$(best_of "${spm_enc[@]}")
bpt() { awk -v b="$VAL_BYTES" -v t="$1" 'BEGIN { printf "%.3f", b / t }'; }
mbs() { awk -v b="$VAL_BYTES" -v t="$1" 'BEGIN { printf "%.1f", b / 1e6 / t }'; }

echo "fortunes corpus: $BYTES bytes; train: first $CUT bytes; validation: last $VAL_BYTES bytes ($VAL_LINES lines)"
echo "vocabulary asked: $N; rounds: $ROUNDS (best time of each shown; times include process start and file I/O)"
echo "ours: $OURS_VOCAB"
echo "sentencepiece $(dpkg-query -W -f='${Version}' sentencepiece 2>/dev/null || echo '?'): $SPM_VOCAB pieces; spm_train ${SPM_OPTS[*]}"
echo
echo "| trainer | train s | val tokens | bytes/token | encode s (val) | encode MB/s | decode(encode(x)) == x |"
echo "|---|---|---|---|---|---|---|"
echo "| typegrad train_byte_bpe | $OT | $OURS_TOKENS | $(bpt "$OURS_TOKENS") | $OE | $(mbs "$OE") | $OURS_RT |"
echo "| SentencePiece BPE | $ST | $SPM_TOKENS | $(bpt "$SPM_TOKENS") | $SE | $(mbs "$SE") | $SPM_RT |"
echo
echo "train s, all rounds: ours ${ours_train[*]}; sentencepiece ${spm_train_t[*]}"
