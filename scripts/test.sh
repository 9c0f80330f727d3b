#!/usr/bin/env bash
# Builds everything with the `release` preset (the CUDA backend too when nvcc is found: CI must compile
# it) and runs the whole CTest suite, then the sanitizer stage (scripts/sanitize.sh: the `debug-asan`
# preset, tests labelled `sanitize` under ASan + UBSan). A failing build step does not stop the other
# targets or the tests (so CTest's summary is always printed), but the script exits non-zero when anything
# failed, in either stage.
#   bash scripts/test.sh                  # TG_TEST_JOBS=2, TG_TEST_TIMEOUT=1500 (seconds per test)
#   bash scripts/test.sh -L compile_fail  # extra arguments go to the release stage's ctest
#   TG_SANITIZE_STAGE=0 bash scripts/test.sh   # without the sanitizer stage
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

JOBS="${TG_TEST_JOBS:-2}"
TIMEOUT="${TG_TEST_TIMEOUT:-1500}"

bash scripts/install-deps.sh

echo "== configure (preset release)"
cmake --preset release
echo "== build"
build_rc=0
SECONDS=0
cmake --build --preset release -j"${JOBS}" -- -k 0 || build_rc=$?
echo "== build took ${SECONDS}s (rc ${build_rc})"
echo "== test"
# CTest runs JOBS test processes at once on a 2-core machine; an OpenMP team per process on top puts more
# threads than cores, and OpenMP's spinning barriers then cost 10x (measured: a tiny GPT training step
# went from 0.44 s to 4.2 s). Tests that need a thread count (Philox thread-independence) set their own.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
test_rc=0
ctest --preset release --output-on-failure --timeout "${TIMEOUT}" -j"${JOBS}" "$@" || test_rc=$?

# The sanitizer stage runs whatever the release stage gave (its findings are worth having either way).
sanitize_rc=0
bash scripts/sanitize.sh || sanitize_rc=$?

if [ "${build_rc}" -ne 0 ]; then
  echo "scripts/test.sh: the build failed (rc ${build_rc}); see the FAILED lines above" >&2
  exit "${build_rc}"
fi
if [ "${test_rc}" -ne 0 ]; then
  exit "${test_rc}"
fi
if [ "${sanitize_rc}" -ne 0 ]; then
  echo "scripts/test.sh: the sanitizer stage failed (rc ${sanitize_rc}); see scripts/sanitize.sh's output above" >&2
  exit "${sanitize_rc}"
fi
