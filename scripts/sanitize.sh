#!/usr/bin/env bash
# The sanitizer stage of CI (scripts/test.sh runs it after the release tests): configures the `debug-asan`
# preset (build/asan: CPU only, -O0, -g1: line tables, enough for the reports' file:line; -fsanitize=address,
# undefined -fno-sanitize-recover=all), builds only the target tg_sanitize_build (the executables of the tests
# labelled `sanitize`, tests/CMakeLists.txt) and runs the CTest label `sanitize` with findings fatal: ASan (leaks
# included) and UBSan stop the process at the first report, which fails its test. A build failure or a failed
# test makes the script exit non-zero. It takes about 11 minutes on CI's 2 cores with a cold compiler cache
# (2026-12-07 on the Zen 4 VM: build 463 s, tests 193 s; docs/performance.md, "CI").
#   bash scripts/sanitize.sh                 # TG_TEST_JOBS=2, TG_SANITIZE_TIMEOUT=900 (seconds per test)
#   bash scripts/sanitize.sh -R smoke        # extra arguments go to ctest
#   TG_SANITIZE_STAGE=0 bash scripts/test.sh # skips the stage (a quick local run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${TG_SANITIZE_STAGE:-1}" = "0" ]; then
  echo "== sanitizer stage skipped (TG_SANITIZE_STAGE=0)"
  exit 0
fi
JOBS="${TG_TEST_JOBS:-2}"
TIMEOUT="${TG_SANITIZE_TIMEOUT:-900}"

STAGE_START=$SECONDS
echo "== sanitizer stage: configure (preset debug-asan)"
cmake --preset debug-asan
echo "== sanitizer stage: build (target tg_sanitize_build)"
build_rc=0
start=$SECONDS
cmake --build --preset debug-asan -j"${JOBS}" --target tg_sanitize_build -- -k 0 || build_rc=$?
echo "== sanitizer stage: build took $((SECONDS - start))s (rc ${build_rc})"
if [ "${build_rc}" -ne 0 ]; then
  echo "scripts/sanitize.sh: the build failed (rc ${build_rc}); see the FAILED lines above" >&2
  exit "${build_rc}"
fi

echo "== sanitizer stage: tests (label sanitize)"
# halt_on_error: the first report ends the process (the build's -fno-sanitize-recover=all does it for UBSan
# too); detect_leaks: LeakSanitizer at exit; allocator_may_return_null: an allocation too large for ASan
# returns null as malloc would (the allocator must turn it into a tg::Error, which tests check) instead of
# aborting; detect_stack_use_after_return: a pointer into a returned frame (measured: +5% time); one
# OpenMP thread per test process (two run at once).
export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:print_stacktrace=1:allocator_may_return_null=1:strict_string_checks=1:check_initialization_order=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:${ASAN_OPTIONS}}"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1${UBSAN_OPTIONS:+:${UBSAN_OPTIONS}}"
export OMP_NUM_THREADS=1
test_rc=0
start=$SECONDS
ctest --preset debug-asan -L sanitize --no-tests=error --timeout "${TIMEOUT}" -j"${JOBS}" "$@" || test_rc=$?
echo "== sanitizer stage: tests took $((SECONDS - start))s (rc ${test_rc}); the stage $((SECONDS - STAGE_START))s"
exit "${test_rc}"
