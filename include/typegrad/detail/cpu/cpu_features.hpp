// Run-time CPU feature detection (cpuid + xgetbv) and the ISA levels the CPU kernels are compiled for.
//   if (tg::backend::cpu::cpu_features().avx512f) { ... }        // the CPU *and* the OS support zmm state
//   std::puts(tg::backend::cpu::cpu_features_string().c_str());  // "avx2 fma f16c avx512f ..."
#pragma once

#include <string>
#include <string_view>

namespace tg::backend::cpu {

/// What this CPU can run. A vector feature is reported only when the OS also saves its register
/// state (XCR0 via xgetbv): avx2/fma/f16c need XMM|YMM, the avx512* flags need opmask|ZMM_Hi256|Hi16_ZMM.
struct CpuFeatures {
  bool sse42 = false;
  bool avx = false;
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512dq = false;
  bool avx512_vnni = false;
  bool avx512_bf16 = false;
  bool avx512_fp16 = false;
  bool amx_bf16 = false;
  bool amx_int8 = false;  // cpuid 7.0 EDX bit 25 (tdpbssd); like amx_bf16, before the OS permission request
  std::string vendor;  // "AuthenticAMD", "GenuineIntel", ...
  int family = 0;      // display family (base + extended)
  int model = 0;       // display model (base + extended << 4)
};

/// Data cache sizes in bytes: L1d and L2 per core, L3 per cache instance. Read from Linux's
/// /sys/devices/system/cpu/cpu0/cache; where that has no cache information (some virtual machines), from
/// cpuid's deterministic cache parameters (leaf 4 on Intel, 0x8000001D on AMD); a level neither reports
/// keeps a conservative default (32 KiB, 512 KiB, 8 MiB). `source` says which: "sysfs", "cpuid" or "defaults".
struct CpuCacheSizes {
  long l1d = 32 * 1024;
  long l2 = 512 * 1024;
  long l3 = 8 * 1024 * 1024;
  const char* source = "defaults";
};
const CpuCacheSizes& cpu_cache_sizes();

/// Detected once (thread-safe static), then cached.
const CpuFeatures& cpu_features();

/// Space-separated list of the flags above that are set, prefixed by vendor/family/model, e.g.
/// "AuthenticAMD family 25 model 1: sse4.2 avx avx2 fma f16c".
std::string cpu_features_string();

// Note [ISA kernel levels]
// The packed kernels (backends/cpu/gemm_*.cpp) are compiled for one ISA level each, whatever the build
// flags, and are chosen at run time. A level is usable when the CPU reports all of its features:
//   avx2       : avx2 + fma + f16c
//   avx512     : avx512f + avx512bw + avx512vl + avx512dq + fma + f16c
//   avx512bf16 : avx512 + avx512_bf16 (vdpbf16ps)
// `reference` (the Eigen path) is always usable. TG_GEMM_KERNEL=<name> forces one level; forcing a level
// the CPU lacks throws tg::Error naming the missing level and the detected features.
enum class CpuIsa { reference, avx2, avx512, avx512bf16 };

std::string_view cpu_isa_name(CpuIsa isa);
/// Parses "reference" | "avx2" | "avx512" | "avx512bf16"; throws tg::Error on anything else.
CpuIsa parse_cpu_isa(std::string_view name);
/// Whether this CPU (and OS) can run kernels of that level.
bool cpu_supports(CpuIsa isa);
/// The best level this CPU supports.
CpuIsa best_cpu_isa();

}  // namespace tg::backend::cpu
