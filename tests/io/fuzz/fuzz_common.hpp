// Shared by the libFuzzer targets that load through a path (fuzz_load_weights, fuzz_train_state): a
// per-process scratch file for the fuzz input and byte snapshots of parameters to check "loses nothing".
//   const std::string& p = tg_fuzz::scratch_path("load_weights");  tg_fuzz::write_bytes(p, data, size);
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "typegrad/optim/optimizer.hpp"

namespace tg_fuzz {

/// "<dir>/tg_fuzz_<what>.<pid>.safetensors" in /dev/shm when it exists (no disk writes per input), else
/// $TMPDIR or /tmp; removed at exit.
inline const std::string& scratch_path(const char* what) {
  static const std::string path = [&] {
    std::string dir = "/tmp";
    if (::access("/dev/shm", W_OK) == 0) dir = "/dev/shm";
    else if (const char* t = std::getenv("TMPDIR"); t && *t) dir = t;
    return dir + "/tg_fuzz_" + what + "." + std::to_string(::getpid()) + ".safetensors";
  }();
  static const bool registered = [] {
    std::atexit([] { ::unlink(path.c_str()); });
    return true;
  }();
  (void)registered;
  return path;
}

/// Writes the bytes to `path` (truncating); traps when that fails (a harness problem, not a finding).
inline void write_bytes(const std::string& path, const void* data, std::size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) __builtin_trap();
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w <= 0) __builtin_trap();
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  ::close(fd);
}

/// The bytes of float tensors, for before/after comparisons.
inline std::vector<float> snapshot(const std::vector<tg::Tensor<tg::fp32>>& ts) {
  std::vector<float> out;
  for (const auto& t : ts) out.insert(out.end(), t.data(), t.data() + t.numel());
  return out;
}
inline std::vector<float> snapshot(const std::vector<tg::optim::Param>& ps) {
  std::vector<tg::Tensor<tg::fp32>> ts;
  for (const auto& p : ps) ts.push_back(p.tensor);
  return snapshot(ts);
}
inline bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

}  // namespace tg_fuzz
