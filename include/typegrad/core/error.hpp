// tg::Error and the checking macros: every message names the op, the argument, expected vs actual.
//   TG_CHECK(a.dim() >= 2, "matmul: a must have at least 2 dims, got ", a.shape());
//   throw tg::Error("safetensors: ", path, ": header length ", n, " exceeds the file size ", size);
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace tg {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
  template <class... Parts>
    requires(sizeof...(Parts) > 1)
  explicit Error(Parts&&... parts) : std::runtime_error(concat(std::forward<Parts>(parts)...)) {}

  template <class... Parts>
  static std::string concat(Parts&&... parts) {
    std::ostringstream os;
    (os << ... << std::forward<Parts>(parts));
    return os.str();
  }
};

}  // namespace tg

#define TG_CHECK(cond, ...)                                 \
  do {                                                      \
    if (!(cond)) [[unlikely]] throw ::tg::Error(__VA_ARGS__, ""); \
  } while (0)
