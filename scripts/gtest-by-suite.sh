#!/usr/bin/env bash
# Runs each GoogleTest suite of a test binary in a process of its own, JOBS at a time, and prints the
# processes' outputs one after another in suite order. On a GPU a kernel's illegal address is sticky for its
# process: run as one process, the first such fault fails every test after it, and the run says nothing
# about them; run by suite, it takes only its own suite down. Exit status 0 when every suite's process
# exited 0; on SIGTERM (gpu-check's time limit) it prints what the suites wrote so far and exits 124.
#   bash scripts/gtest-by-suite.sh build/gpu/tests/test_cuda '*' 4
#   bash scripts/gtest-by-suite.sh build/gpu/tests/test_ops '*cuda*' 4
set -uo pipefail
[ $# -ge 1 ] && [ -x "$1" ] || {
  echo "usage: gtest-by-suite.sh TEST_BINARY [GTEST_FILTER] [JOBS] (got '${1:-}', not an executable)" >&2
  exit 2
}
BIN=$1 FILTER=${2:-*} JOBS=${3:-4}
case "$JOBS" in '' | *[!0-9]* | 0) echo "gtest-by-suite.sh: JOBS must be a positive whole number, got '$JOBS'" >&2 && exit 2 ;; esac
DIR=$(mktemp -d)
finish() {
  for f in "$DIR"/out.*; do [ -e "$f" ] && cat "$f"; done
  rm -rf "$DIR"
}
trap 'finish; exit 124' TERM INT  # timeout signals the whole process group: the suites stop too

if ! "$BIN" --gtest_list_tests --gtest_filter="$FILTER" >"$DIR/list" 2>&1; then
  echo "gtest-by-suite.sh: $BIN --gtest_list_tests failed:"
  cat "$DIR/list"
  rm -rf "$DIR"
  exit 1
fi
# Suite lines start in column 1 ("Suite." or "Suite/0.  # TypeParam = ..."); test lines are indented
# ("  name" or "  name/0  # GetParam() = ..."). One file of full test names per suite, numbered in order.
awk -v dir="$DIR" '
  /^[^ ]/ { suite = $1; n++; next }
  /^  [^ ]/ { printf "%s%s\n", suite, $1 > (dir "/tests." sprintf("%05d", n)) }
' "$DIR/list"
ls "$DIR"/tests.* >/dev/null 2>&1 || {
  echo "gtest-by-suite.sh: no test of $BIN matches '$FILTER'"
  rm -rf "$DIR"
  exit 1
}

run_one() {  # run_one TESTS_FILE: that suite's tests in one process
  local idx=${1##*.}
  "$BIN" --gtest_filter="$(paste -sd: "$1")" >"$DIR/out.$idx" 2>&1
  echo $? >"$DIR/rc.$idx"
}
export -f run_one
export BIN DIR
printf '%s\n' "$DIR"/tests.* | xargs -P "$JOBS" -I{} bash -c 'run_one "$1"' _ {}

status=0
for f in "$DIR"/tests.*; do
  idx=${f##*.}
  rc=$(cat "$DIR/rc.$idx" 2>/dev/null || echo missing)
  [ "$rc" = 0 ] || status=1
done
finish
exit "$status"
