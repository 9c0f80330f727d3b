// tg::pointwise on the GPU: the expression's CUDA source, compiled by NVRTC once per source and device, loaded
// with the runtime's library API and launched on the current stream (Note [pointwise kernels through NVRTC]).
#include <cuda_runtime.h>
#include <nvrtc.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/detail/cuda/pointwise.hpp"
#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"

namespace tg::backend::cuda {

// Note [pointwise kernels through NVRTC]
// tg::pointwise's expression is a C++ type; the host compiler cannot instantiate a device kernel from it in a
// program nvcc never sees. So the expression prints itself as CUDA source (x0 + tg_lit<S>(L[0]), tg_tanh(...)),
// and this file wraps it into a translation unit: the scalar functions for float / double and for dual numbers
// (the CPU's forward-mode derivatives, written again in CUDA), 16-bit loads and stores written as dtype.hpp's
// reference conversions in integer code (round-to-nearest-even, NaN payloads; no CUDA headers, so NVRTC needs
// no include path), a grid-stride loop that splits each output index into the operands' strided offsets, and
// two `extern "C"` kernels: tg_pw_fwd (one output) and tg_pw_bwd (one gradient per input over the output's
// shape, from the output's gradient). The expression's literals are a table in the launch arguments (L[k]),
// not text, so an expression whose constants change from step to step (a temperature, a schedule's factor)
// compiles once; past 16 literals the rest are written as their exact bits. NVRTC compiles the unit to a cubin
// for the current GPU's architecture (or the nearest earlier one of its major that this NVRTC knows; for a GPU
// newer than the toolkit, to PTX that the driver compiles), and both kernels are loaded into the context at the
// forward's first call (their attributes asked, which lazy module loading counts as a use), so a backward never
// meets a load failure; the result, or the failure, is cached by source and device for the process. A failure
// to compile, load or launch is returned, not thrown: the op then runs as tensor ops, which compute the same
// function. What the launch watch throws (a compiled step's checks, a CUDA graph's failed stretch) and a launch
// that fails inside a graph's capture are the step's errors, thrown as for any kernel. sigmoid and relu have
// math::apply's forms (sigmoid as e^x / (1 + e^x) below 0, so it does not underflow early; relu passes NaN and -0
// through), as the CPU's f_sigmoid / f_relu and the tensor ops, so a chain of the fusion rewrite (Note [fusion
// rewrites]) computes what its separate ops compute.

namespace {

constexpr int kPointwiseThreads = 256;  // a launch's block

const char* kPrelude = R"(
typedef long long i64;
struct TgArgs { const void* in[8]; void* out[8]; i64 n; i64 nd; i64 size[8]; i64 st[8][8]; double lit[16]; };
template <class A, int N> struct Dual { A v; A d[N]; };
template <class A, int N> __device__ Dual<A, N> operator+(Dual<A, N> a, Dual<A, N> b) { Dual<A, N> r; r.v = a.v + b.v; for (int i = 0; i < N; ++i) r.d[i] = a.d[i] + b.d[i]; return r; }
template <class A, int N> __device__ Dual<A, N> operator-(Dual<A, N> a, Dual<A, N> b) { Dual<A, N> r; r.v = a.v - b.v; for (int i = 0; i < N; ++i) r.d[i] = a.d[i] - b.d[i]; return r; }
template <class A, int N> __device__ Dual<A, N> operator-(Dual<A, N> a) { Dual<A, N> r; r.v = -a.v; for (int i = 0; i < N; ++i) r.d[i] = -a.d[i]; return r; }
template <class A, int N> __device__ Dual<A, N> operator*(Dual<A, N> a, Dual<A, N> b) { Dual<A, N> r; r.v = a.v * b.v; for (int i = 0; i < N; ++i) r.d[i] = a.d[i] * b.v + a.v * b.d[i]; return r; }
template <class A, int N> __device__ Dual<A, N> operator/(Dual<A, N> a, Dual<A, N> b) { Dual<A, N> r; r.v = a.v / b.v; for (int i = 0; i < N; ++i) r.d[i] = (a.d[i] - r.v * b.d[i]) / b.v; return r; }
template <class A, int N> __device__ Dual<A, N> tg_chain(Dual<A, N> a, A f, A df) { Dual<A, N> r; r.v = f; for (int i = 0; i < N; ++i) r.d[i] = a.d[i] * df; return r; }
template <class S> struct TgLit { static __device__ S make(double c) { return S(c); } };
template <class A, int N> struct TgLit<Dual<A, N> > { static __device__ Dual<A, N> make(double c) { Dual<A, N> r; r.v = A(c); for (int i = 0; i < N; ++i) r.d[i] = A(0); return r; } };
template <class S> __device__ S tg_lit(double c) { return TgLit<S>::make(c); }
__device__ float tg_exp(float a) { return expf(a); }
__device__ double tg_exp(double a) { return exp(a); }
__device__ float tg_log(float a) { return logf(a); }
__device__ double tg_log(double a) { return log(a); }
__device__ float tg_tanh(float a) { return tanhf(a); }
__device__ double tg_tanh(double a) { return tanh(a); }
__device__ float tg_sqrt(float a) { return sqrtf(a); }
__device__ double tg_sqrt(double a) { return sqrt(a); }
template <class A> __device__ A tg_sigmoid(A a) { if (a >= A(0)) return A(1) / (A(1) + tg_exp(-a)); const A e = tg_exp(a); return e / (A(1) + e); }
template <class A> __device__ A tg_relu(A a) { return a < A(0) ? A(0) : a; }
template <class A, int N> __device__ Dual<A, N> tg_exp(Dual<A, N> a) { const A e = tg_exp(a.v); return tg_chain(a, e, e); }
template <class A, int N> __device__ Dual<A, N> tg_log(Dual<A, N> a) { return tg_chain(a, tg_log(a.v), A(1) / a.v); }
template <class A, int N> __device__ Dual<A, N> tg_tanh(Dual<A, N> a) { const A t = tg_tanh(a.v); return tg_chain(a, t, A(1) - t * t); }
template <class A, int N> __device__ Dual<A, N> tg_sqrt(Dual<A, N> a) { const A s = tg_sqrt(a.v); return tg_chain(a, s, A(0.5) / s); }
template <class A, int N> __device__ Dual<A, N> tg_sigmoid(Dual<A, N> a) { const A s = tg_sigmoid(a.v); return tg_chain(a, s, s * (A(1) - s)); }
template <class A, int N> __device__ Dual<A, N> tg_relu(Dual<A, N> a) { if (a.v > A(0)) return a; Dual<A, N> r = tg_lit<Dual<A, N> >(0.0); r.v = tg_relu(a.v); return r; }
__device__ void tg_offsets(const TgArgs& g, i64 i, int K, i64* off) {
  for (int k = 0; k < K; ++k) off[k] = 0;
  for (int d = (int)g.nd - 1; d >= 0; --d) {
    const i64 n = g.size[d], q = i / n, c = i - q * n;
    for (int k = 0; k < K; ++k) off[k] += c * g.st[k][d];
    i = q;
  }
}
)";

// Loads and stores of the element type, in the accumulation type A.
const char* storage_code(DType d) {
  switch (d) {
    case DType::f32:
      return "typedef float T; typedef float A;\n"
             "__device__ A tg_ld(const void* p, i64 i) { return ((const T*)p)[i]; }\n"
             "__device__ void tg_st(void* p, i64 i, A v) { ((T*)p)[i] = v; }\n";
    case DType::f64:
      return "typedef double T; typedef double A;\n"
             "__device__ A tg_ld(const void* p, i64 i) { return ((const T*)p)[i]; }\n"
             "__device__ void tg_st(void* p, i64 i, A v) { ((T*)p)[i] = v; }\n";
    case DType::bf16:
      return "typedef unsigned short T; typedef float A;\n"
             "__device__ A tg_ld(const void* p, i64 i) { return __uint_as_float(((unsigned)((const T*)p)[i]) << 16); }\n"
             "__device__ void tg_st(void* p, i64 i, A v) {\n"
             "  const unsigned x = __float_as_uint(v);\n"
             "  unsigned short b;\n"
             "  if ((x & 0x7fffffffu) > 0x7f800000u) { unsigned u = x >> 16; if ((u & 0x7fu) == 0) u |= 0x40u; b = (unsigned short)u; }\n"
             "  else b = (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);\n"
             "  ((T*)p)[i] = b;\n"
             "}\n";
    case DType::f16:  // dtype.hpp's fp16_bits_to_fp32 / fp32_to_fp16_bits, NaN payloads included
      return "typedef unsigned short T; typedef float A;\n"
             "__device__ A tg_ld(const void* p, i64 i) {\n"
             "  const unsigned h = ((const T*)p)[i], sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;\n"
             "  if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));\n"
             "  if (e == 0) return __uint_as_float(sign | __float_as_uint(__fmul_rn((float)m, 5.9604644775390625e-8f)));\n"
             "  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));\n"
             "}\n"
             "__device__ void tg_st(void* p, i64 i, A v) {\n"
             "  const unsigned x = __float_as_uint(v), sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;\n"
             "  unsigned r;\n"
             "  if (mag > 0x7f800000u) { unsigned pl = (mag >> 13) & 0x3ffu; if (pl == 0) pl = 0x200u; r = sign | 0x7c00u | pl; }\n"
             "  else if (mag >= 0x477ff000u) r = sign | 0x7c00u;\n"
             "  else if (mag < 0x38800000u) r = sign | (__float_as_uint(__fadd_rn(__uint_as_float(mag), 0.5f)) - 0x3f000000u);\n"
             "  else r = sign | ((mag + 0x0fffu + ((mag >> 13) & 1u) - (112u << 23)) >> 13);\n"
             "  ((T*)p)[i] = (unsigned short)r;\n"
             "}\n";
    default:
      throw Error("pointwise: no GPU kernel for element type ", dtype_name(d));
  }
}

void check_nvrtc(nvrtcResult r, const char* what) {
  if (r != NVRTC_SUCCESS) throw Error("pointwise: ", what, " failed: ", nvrtcGetErrorString(r));
}

/// NVRTC's output for `source` at `arch` ("compute_80": PTX; "sm_90": a cubin); throws with the log.
std::string compile(const std::string& source, const std::string& arch, bool cubin) {
  nvrtcProgram prog = nullptr;
  check_nvrtc(nvrtcCreateProgram(&prog, source.c_str(), "tg_pointwise.cu", 0, nullptr, nullptr), "nvrtcCreateProgram");
  struct Destroy {  // on every path out, the throwing ones included
    nvrtcProgram* p;
    ~Destroy() { nvrtcDestroyProgram(p); }
  } destroy{&prog};
  const std::string arch_opt = "--gpu-architecture=" + arch;
  const char* opts[] = {arch_opt.c_str(), "--std=c++17", "-default-device"};
  const nvrtcResult r = nvrtcCompileProgram(prog, 3, opts);
  if (r != NVRTC_SUCCESS) {
    std::size_t n = 0;
    nvrtcGetProgramLogSize(prog, &n);
    std::string log(n, '\0');
    if (n) nvrtcGetProgramLog(prog, log.data());
    while (!log.empty() && log.back() == '\0') log.pop_back();  // the size counts the terminating NUL
    throw Error("pointwise: NVRTC could not compile the generated kernel (", nvrtcGetErrorString(r), "):\n", log,
                "\nsource:\n", source);
  }
  std::size_t n = 0;
  std::string out;
  if (cubin) {
    check_nvrtc(nvrtcGetCUBINSize(prog, &n), "nvrtcGetCUBINSize");
    out.resize(n);
    check_nvrtc(nvrtcGetCUBIN(prog, out.data()), "nvrtcGetCUBIN");
  } else {
    check_nvrtc(nvrtcGetPTXSize(prog, &n), "nvrtcGetPTXSize");
    out.resize(n);
    check_nvrtc(nvrtcGetPTX(prog, out.data()), "nvrtcGetPTX");  // NUL-terminated: the library loader takes it as is
  }
  return out;
}

}  // namespace

std::pair<std::string, bool> pointwise_target(int cc, const std::vector<int>& known) {
  int same_major = -1, below = -1;
  for (const int a : known) {
    if (a == cc) return {"sm_" + std::to_string(a), true};
    if (a / 10 == cc / 10 && a < cc) same_major = std::max(same_major, a);
    if (a < cc) below = std::max(below, a);
  }
  if (same_major > 0) return {"sm_" + std::to_string(same_major), true};
  if (below > 0) return {"compute_" + std::to_string(below), false};
  return {"", false};
}

namespace {

struct Loaded {
  cudaLibrary_t library = nullptr;
  cudaKernel_t fwd = nullptr, bwd = nullptr;
  std::string failure;  // why the source cannot run on this device (then nothing is loaded)
};
std::mutex g_mutex;
std::int64_t g_compiles = 0;  // under g_mutex
std::map<std::pair<std::string, int>, Loaded> g_loaded;  // never unloaded (process lifetime)

/// The source compiled and loaded for device `dev`, both kernels; throws tg::Error when that fails.
Loaded load(const std::string& source, int dev) {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("pointwise: cudaGetDeviceProperties failed");
  }
  int count = 0;
  check_nvrtc(nvrtcGetNumSupportedArchs(&count), "nvrtcGetNumSupportedArchs");
  std::vector<int> known(static_cast<std::size_t>(std::max(count, 0)));
  if (count > 0) check_nvrtc(nvrtcGetSupportedArchs(known.data()), "nvrtcGetSupportedArchs");
  const int cc = p.major * 10 + p.minor;
  const auto [arch, cubin] = pointwise_target(cc, known);
  if (arch.empty()) throw Error("pointwise: NVRTC knows no architecture at or below this GPU's (compute capability ", p.major, ".", p.minor, ")");
  const std::string image = compile(source, arch, cubin);
  Loaded l;
  cudaError_t st = cudaLibraryLoadData(&l.library, image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("pointwise: cudaLibraryLoadData failed: ", cudaGetErrorString(st));
  }
  for (auto [kernel, name] : {std::pair{&l.fwd, "tg_pw_fwd"}, std::pair{&l.bwd, "tg_pw_bwd"}}) {
    st = cudaLibraryGetKernel(kernel, l.library, name);
    // Under lazy module loading (the default since CUDA 12.2) a kernel reaches the context at its first use: asking
    // for its attributes is such a use, so a failure to load the backward shows here, not inside a backward.
    cudaFuncAttributes fa{};
    if (st == cudaSuccess) st = cudaFuncGetAttributes(&fa, reinterpret_cast<const void*>(*kernel));
    if (st == cudaSuccess && fa.maxThreadsPerBlock < kPointwiseThreads) st = cudaErrorInvalidConfiguration;
    if (st != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaLibraryUnload(l.library);
      throw Error("pointwise: loading ", name, " failed: ", cudaGetErrorString(st),
                  st == cudaErrorInvalidConfiguration ? " (fewer threads per block than the launch's)" : "");
    }
  }
  return l;
}

}  // namespace

std::string pointwise_source(DType dtype, int K, const std::string& expr) {
  if (K < 1 || K > kPointwiseMaxOperands - 1) throw Error("pointwise: ", K, " inputs (the GPU kernel takes 1 to 7)");
  std::string s = kPrelude;
  s += storage_code(dtype);
  std::string params, call = "g.lit";
  for (int k = 0; k < K; ++k) {
    params += ", S x" + std::to_string(k);
    call += ", x" + std::to_string(k);
  }
  s += "template <class S> __device__ S tg_f(const double* L" + params + ") { return " + expr + "; }\n";
  const std::string Ks = std::to_string(K);
  for (const bool backward : {false, true}) {
    s += "extern \"C\" __global__ void " + std::string(backward ? "tg_pw_bwd" : "tg_pw_fwd") + "(TgArgs g) {\n";
    s += "  const i64 stride = (i64)gridDim.x * blockDim.x;\n";
    s += "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < g.n; i += stride) {\n";
    s += "    i64 off[" + Ks + "];\n    tg_offsets(g, i, " + Ks + ", off);\n";
    if (!backward) {
      for (int k = 0; k < K; ++k) {
        const std::string ks = std::to_string(k);
        s += "    const A x" + ks + " = tg_ld(g.in[" + ks + "], off[" + ks + "]);\n";
      }
      s += "    tg_st(g.out[0], i, tg_f<A>(" + call + "));\n";
    } else {
      for (int k = 0; k < K; ++k) {
        const std::string ks = std::to_string(k);
        s += "    Dual<A, " + Ks + "> x" + ks + "; x" + ks + ".v = tg_ld(g.in[" + ks + "], off[" + ks + "]);";
        s += " for (int j = 0; j < " + Ks + "; ++j) x" + ks + ".d[j] = A(j == " + ks + ");\n";
      }
      s += "    const Dual<A, " + Ks + "> r = tg_f<Dual<A, " + Ks + "> >(" + call + ");\n";
      s += "    const A dy = tg_ld(g.in[" + Ks + "], i);\n";
      s += "    for (int k = 0; k < " + Ks + "; ++k) if (g.out[k]) tg_st(g.out[k], i, dy * r.d[k]);\n";
    }
    s += "  }\n}\n";
  }
  return s;
}

std::string pointwise_ptx(const std::string& source) { return compile(source, "compute_80", false); }

std::int64_t pointwise_compiles() {
  const std::lock_guard<std::mutex> lock(g_mutex);
  return g_compiles;
}

bool pointwise_run(const std::string& source, bool backward, const PointwiseArgs& args, std::string* why) {
  if (args.n == 0) return true;
  Loaded l;
  try {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
      (void)cudaGetLastError();
      throw Error("pointwise: cudaGetDevice failed");
    }
    {
      // NVRTC runs under the lock, once per source and device: other threads' first calls wait for it.
      const std::lock_guard<std::mutex> lock(g_mutex);
      const auto key = std::make_pair(source, dev);
      auto it = g_loaded.find(key);
      if (it == g_loaded.end()) {
        Loaded fresh;
        ++g_compiles;
        try {
          fresh = load(source, dev);
        } catch (const Error& e) {
          fresh.failure = e.what();  // remembered: the next call falls back at once
        }
        it = g_loaded.emplace(key, fresh).first;
      }
      l = it->second;
    }
    if (!l.failure.empty()) throw Error(l.failure);
  } catch (const Error& e) {  // no kernel for this source here: the caller runs the tensor ops
    if (why) *why = e.what();
    return false;
  }
  const long long blocks = std::min<long long>((args.n + kPointwiseThreads - 1) / kPointwiseThreads, 65535LL * 16);
  PointwiseArgs a = args;
  // Note [launch watch]. Not a fallback case: what a watcher throws (a compiled step's check, the end of a CUDA
  // graph's stretch that failed) is the step's error, as for every other kernel.
  report_launch(backward ? "pointwise_backward" : "pointwise_forward", false, source, a);
  void* params[] = {&a};
  const auto stream = static_cast<cudaStream_t>(current_stream());
  const cudaError_t st = cudaLaunchKernel(reinterpret_cast<const void*>(backward ? l.bwd : l.fwd),
                                          dim3(static_cast<unsigned>(blocks)), dim3(kPointwiseThreads), params, 0, stream);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    if (current_stream_capturing()) {  // inside a CUDA graph's capture the tensor ops cannot stand in: the step fails
      throw Error("pointwise: the launch failed inside a CUDA graph capture: ", cudaGetErrorString(st));
    }
    if (why) *why = std::string("pointwise: the launch failed: ") + cudaGetErrorString(st);
    return false;
  }
  return true;
}

}  // namespace tg::backend::cuda
