#!/usr/bin/env bash
# Packs the build dependencies that a GPU machine without network access may lack (Eigen, nlohmann_json,
# CLI11: headers and CMake package files; GoogleTest: headers, static libraries and CMake package files)
# from this Debian machine into a prefix folder, by default `.gpu-deps/` in the repository root (ignored by
# git). scripts/gpu-check.sh puts that folder first on CMAKE_PREFIX_PATH when it exists, so copying the
# repository with it onto the GPU machine is enough to configure and build there.
# The CMake package files locate their headers and libraries relative to their own place, so the folder
# mirrors /usr's layout and works wherever it is copied.
#   bash scripts/install-deps.sh && bash scripts/gpu-deps.sh            # .gpu-deps/
#   bash scripts/gpu-deps.sh /tmp/prefix                               # elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-deps}
ARCH_LIB=lib/$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

# copy PATH...: each /usr/PATH to DEST/PATH (a folder whole, or files by glob); a missing one is an error.
copy() {
  local p
  for p in "$@"; do
    local matches
    # shellcheck disable=SC2206  # the glob is meant to expand
    matches=(/usr/$p)
    [ -e "${matches[0]}" ] || { echo "gpu-deps: /usr/$p is missing (run scripts/install-deps.sh first)" >&2; exit 1; }
    local m
    for m in "${matches[@]}"; do
      local rel=${m#/usr/}
      mkdir -p "$DEST/$(dirname "$rel")"
      cp -a "$m" "$DEST/$rel"
    done
  done
}

rm -rf "$DEST"
copy include/eigen3 share/eigen3/cmake
copy include/nlohmann share/cmake/nlohmann_json
copy include/CLI share/cmake/CLI11
copy include/gtest include/gmock "$ARCH_LIB/libgtest*.a" "$ARCH_LIB/libgmock*.a" "$ARCH_LIB/cmake/GTest"
echo "gpu-deps: $(du -sh "$DEST" | cut -f1) in $DEST (Eigen, nlohmann_json, CLI11, GoogleTest)"
