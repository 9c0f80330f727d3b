#!/usr/bin/env bash
# Installs the Debian 12 packages typegrad needs to build, test and train. Fast (no apt calls) when every
# package is already there; quiet otherwise. Works as root without a tty (uses sudo when not root).
#   bash scripts/install-deps.sh
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache    # toolchain
  libeigen3-dev                               # CPU GEMM (build-only dependency of typegrad_cpu)
  libgtest-dev libgmock-dev libbenchmark-dev  # tests, benchmarks
  libcli11-dev nlohmann-json3-dev             # example CLIs, JSON (tokenizer vocabularies, configs)
  fortunes                                    # a small text corpus for the examples and data tests
  python3-torch python3-numpy                 # reference values (tests/reference, benchmarks)
  python3-matplotlib                          # train_gpt --plot (scripts/plot_log.py)
  libopenblas0-pthread                        # an optimized BLAS for PyTorch (else netlib BLAS at 1-5 GFLOP/s)
  clang libclang-rt-14-dev libomp-dev         # second compiler, sanitizer runtimes, libFuzzer, clang OpenMP (tests/io/fuzz)
  libopenmpi-dev openmpi-bin                  # tg::dist's MPI communicator and mpirun (data-parallel training, tests/dist)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq </dev/null
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}" </dev/null >/dev/null
echo "install-deps: done"
