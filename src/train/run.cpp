// A run's id and the progress line's formats (include/typegrad/train/run.hpp).
#include "typegrad/train/run.hpp"

#include <unistd.h>

#include <cstdio>
#include <random>

namespace tg::train {

std::string new_run_id() {
  std::random_device rd;
  const std::uint64_t t = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32 ^ rd()) ^ (t * 0x9E3779B97F4A7C15ull) ^
                          static_cast<std::uint64_t>(::getpid());
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string human_bytes(std::int64_t b) {
  char buf[32];
  if (b >= (std::int64_t{1} << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1ll << 30));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}

std::string human_time(double s) {
  char buf[32];
  const long long total = static_cast<long long>(s > 0 ? s : 0);
  std::snprintf(buf, sizeof buf, "%lldm%02llds", total / 60, total % 60);
  return buf;
}

}  // namespace tg::train
