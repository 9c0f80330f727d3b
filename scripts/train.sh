#!/usr/bin/env bash
# Installs the dependencies, builds the `release` preset and runs the example trainer.
#   bash scripts/train.sh [args for the example...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The example that trains: the target and its path under the build dir. Switching to the GPT trainer is
# this one line:  EXAMPLE=examples/gpt/train_gpt
EXAMPLE=examples/gpt/train_gpt   # default run: the tiny GPT on the fortunes corpus, about five minutes on 2 cores

JOBS="${TG_TRAIN_JOBS:-2}"
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j"${JOBS}" --target "$(basename "${EXAMPLE}")"
exec "build/release/${EXAMPLE}" "$@"
