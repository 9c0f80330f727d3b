#!/usr/bin/env bash
# Installs the dependencies, builds the `release` preset and runs the example trainer.
#   bash scripts/train.sh [args for the example...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The example that trains: the target and its path under the build dir. With no arguments it trains the
# tiny GPT on the fortunes corpus for 2000 steps (about five minutes on 2 cores).
EXAMPLE=examples/gpt/train_gpt

JOBS="${TG_TRAIN_JOBS:-2}"
bash scripts/install-deps.sh
cmake --preset release >/dev/null
cmake --build --preset release -j"${JOBS}" --target "$(basename "${EXAMPLE}")"
exec "build/release/${EXAMPLE}" "$@"
