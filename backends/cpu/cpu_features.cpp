// Run-time CPU feature detection: cpuid leaves 0, 1, 7.0, 7.1 and XCR0 (xgetbv) for OS state support; cache sizes.
#include "typegrad/detail/cpu/cpu_features.hpp"

#include <cpuid.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "typegrad/core/error.hpp"

namespace tg::backend::cpu {
namespace {

struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub) {
  Regs r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

std::uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}

bool bit(unsigned reg, int i) { return (reg >> i) & 1u; }

CpuFeatures detect() {
  CpuFeatures f;
  const Regs r0 = cpuid(0, 0);
  const unsigned max_leaf = r0.a;
  char vendor[13] = {};
  std::memcpy(vendor + 0, &r0.b, 4);
  std::memcpy(vendor + 4, &r0.d, 4);
  std::memcpy(vendor + 8, &r0.c, 4);
  f.vendor = vendor;
  if (max_leaf < 1) return f;

  const Regs r1 = cpuid(1, 0);
  const int base_family = (r1.a >> 8) & 0xf, base_model = (r1.a >> 4) & 0xf;
  f.family = base_family == 0xf ? base_family + static_cast<int>((r1.a >> 20) & 0xff) : base_family;
  f.model = (base_family == 0xf || base_family == 0x6) ? base_model + static_cast<int>(((r1.a >> 16) & 0xf) << 4)
                                                       : base_model;
  f.sse42 = bit(r1.c, 20);
  const bool osxsave = bit(r1.c, 27);
  // XCR0 bits: 1 = XMM, 2 = YMM upper halves, 5 = opmask, 6 = ZMM_Hi256, 7 = Hi16_ZMM.
  const std::uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  const bool os_ymm = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = os_ymm && (xcr0 & 0xe0) == 0xe0;

  f.avx = os_ymm && bit(r1.c, 28);
  f.fma = f.avx && bit(r1.c, 12);
  f.f16c = f.avx && bit(r1.c, 29);
  if (max_leaf >= 7) {
    const Regs r7 = cpuid(7, 0);
    f.avx2 = f.avx && bit(r7.b, 5);
    f.avx512f = os_zmm && bit(r7.b, 16);
    f.avx512dq = f.avx512f && bit(r7.b, 17);
    f.avx512bw = f.avx512f && bit(r7.b, 30);
    f.avx512vl = f.avx512f && bit(r7.b, 31);
    f.avx512_vnni = f.avx512f && bit(r7.c, 11);
    f.avx512_fp16 = f.avx512f && bit(r7.d, 23);
    f.amx_bf16 = bit(r7.d, 22);  // AMX also needs XCR0 tile bits and a Linux permission request; reported only
    f.amx_int8 = bit(r7.d, 25);  // likewise (amx_int8.cpp asks for the permission before using it)
    if (r7.a >= 1) {
      const Regs r71 = cpuid(7, 1);
      f.avx512_bf16 = f.avx512f && bit(r71.a, 5);
    }
  }
  return f;
}

/// Size of a "32K" / "1024K" / "32M" string from sysfs, in bytes; 0 when it cannot be parsed.
long parse_cache_size(const std::string& text) {
  std::size_t pos = 0;
  long v = 0;
  try {
    v = std::stol(text, &pos);
  } catch (...) {
    return 0;
  }
  const char unit = pos < text.size() ? text[pos] : ' ';
  if (unit == 'K') v *= 1024;
  else if (unit == 'M') v *= 1024 * 1024;
  return v > 0 ? v : 0;
}

/// The data and unified caches of cpuid's deterministic cache parameter leaf (Intel: 4; AMD: 0x8000001D,
/// with topology extensions), same layout in both: EAX[4:0] type (0 = no more caches, 2 = instruction),
/// EAX[7:5] level; size = ways (EBX[31:22]+1) x partitions (EBX[21:12]+1) x line (EBX[11:0]+1) x sets (ECX+1).
/// AMD CPUs whose hypervisor leaves 0x8000001D empty still answer the older leaves: 0x80000005 ECX[31:24]
/// = L1d KiB, 0x80000006 ECX[31:16] = L2 KiB, EDX[31:18] = L3 in 512 KiB units. Returns false when none
/// of them reports a cache.
bool caches_from_cpuid(CpuCacheSizes& c) {
  const std::string& vendor = cpu_features().vendor;
  const bool intel = vendor == "GenuineIntel";
  const bool amd = vendor == "AuthenticAMD" || vendor == "HygonGenuine";
  const unsigned max_leaf = cpuid(0, 0).a, max_ext = cpuid(0x80000000u, 0).a;
  unsigned leaf = 0;
  if (intel && max_leaf >= 4) leaf = 4;
  else if (amd && max_ext >= 0x8000001Du && bit(cpuid(0x80000001u, 0).c, 22)) leaf = 0x8000001Du;  // TopologyExtensions
  bool any = false;
  for (unsigned sub = 0; leaf != 0 && sub < 16; ++sub) {
    const Regs r = cpuid(leaf, sub);
    const unsigned type = r.a & 0x1f, level = (r.a >> 5) & 0x7;
    if (type == 0) break;
    if (type == 2) continue;
    const long bytes = static_cast<long>((r.b >> 22) + 1) * static_cast<long>(((r.b >> 12) & 0x3ff) + 1) *
                       static_cast<long>((r.b & 0xfff) + 1) * static_cast<long>(r.c + 1);
    if (level == 1) c.l1d = bytes;
    else if (level == 2) c.l2 = bytes;
    else if (level == 3) c.l3 = bytes;
    else continue;
    any = true;
  }
  if (!any && amd && max_ext >= 0x80000006u) {
    const long l1d_kib = cpuid(0x80000005u, 0).c >> 24;
    const Regs r6 = cpuid(0x80000006u, 0);
    const long l2_kib = r6.c >> 16, l3_units = r6.d >> 18;
    if (l1d_kib > 0) c.l1d = l1d_kib * 1024;
    if (l2_kib > 0) c.l2 = l2_kib * 1024;
    if (l3_units > 0) c.l3 = l3_units * 512 * 1024;
    any = l1d_kib > 0 || l2_kib > 0;
  }
  return any;
}

CpuCacheSizes detect_caches() {
  CpuCacheSizes c;
  bool any = false;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), type_file(dir + "type"), size_file(dir + "size");
    int level = 0;
    std::string type, size;
    if (!(level_file >> level) || !(type_file >> type) || !(size_file >> size)) continue;
    const long bytes = parse_cache_size(size);
    if (bytes == 0 || type == "Instruction") continue;
    if (level == 1) c.l1d = bytes;
    else if (level == 2) c.l2 = bytes;
    else if (level == 3) c.l3 = bytes;
    else continue;
    any = true;
  }
  if (any) {
    c.source = "sysfs";
  } else if (caches_from_cpuid(c)) {
    c.source = "cpuid";
  }
  return c;
}

}  // namespace

const CpuCacheSizes& cpu_cache_sizes() {
  static const CpuCacheSizes sizes = detect_caches();
  return sizes;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

std::string cpu_features_string() {
  const CpuFeatures& f = cpu_features();
  std::string s = f.vendor + " family " + std::to_string(f.family) + " model " + std::to_string(f.model) + ":";
  const auto add = [&s](bool on, const char* name) {
    if (on) (s += ' ') += name;
  };
  add(f.sse42, "sse4.2");
  add(f.avx, "avx");
  add(f.avx2, "avx2");
  add(f.fma, "fma");
  add(f.f16c, "f16c");
  add(f.avx512f, "avx512f");
  add(f.avx512bw, "avx512bw");
  add(f.avx512vl, "avx512vl");
  add(f.avx512dq, "avx512dq");
  add(f.avx512_vnni, "avx512_vnni");
  add(f.avx512_bf16, "avx512_bf16");
  add(f.avx512_fp16, "avx512_fp16");
  add(f.amx_bf16, "amx_bf16");
  add(f.amx_int8, "amx_int8");
  const CpuCacheSizes& c = cpu_cache_sizes();
  s += "; L1d " + std::to_string(c.l1d / 1024) + " KiB, L2 " + std::to_string(c.l2 / 1024) + " KiB, L3 " +
       std::to_string(c.l3 / 1024) + " KiB (" + c.source + ")";
  return s;
}

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::reference: return "reference";
    case CpuIsa::avx2: return "avx2";
    case CpuIsa::avx512: return "avx512";
    case CpuIsa::avx512bf16: return "avx512bf16";
  }
  return "?";
}

CpuIsa parse_cpu_isa(std::string_view name) {
  for (CpuIsa isa : {CpuIsa::reference, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512bf16})
    if (name == cpu_isa_name(isa)) return isa;
  throw Error("cpu kernel: unknown ISA level '", std::string(name),
              "' (expected reference, avx2, avx512 or avx512bf16)");
}

bool cpu_supports(CpuIsa isa) {
  const CpuFeatures& f = cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case CpuIsa::reference: return true;
    case CpuIsa::avx2: return avx2;
    case CpuIsa::avx512: return avx512;
    case CpuIsa::avx512bf16: return avx512 && f.avx512_bf16;
  }
  return false;
}

CpuIsa best_cpu_isa() {
  for (CpuIsa isa : {CpuIsa::avx512bf16, CpuIsa::avx512, CpuIsa::avx2})
    if (cpu_supports(isa)) return isa;
  return CpuIsa::reference;
}

}  // namespace tg::backend::cpu
