// A test helper: an environment variable set for the lifetime of a guard (the GEMMs read their TG_GEMM_* and
// TG_INT8_* settings on every call).
//   const ScopedEnv pin("TG_INT8_KERNEL", "avx2");   // unset again when the guard goes
#pragma once

#include <cstdlib>
#include <string>

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) { setenv(name, value.c_str(), 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};
