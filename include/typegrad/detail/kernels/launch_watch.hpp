// Watching the CPU backend's kernel launches: what a step would bake into a captured graph
// (Note [launch watch]). TG_BACKEND calls a CPU kernel through backend::Watched, which reports each launch to
// the calling thread's LaunchWatcher, if one is installed, with one hash per argument.
//   struct Log : tg::backend::LaunchWatcher { void on_launch(const tg::backend::Launch& l) override { ... } };
//   Log log;  tg::backend::LaunchWatchScope scope(log);  step();     // every kernel the step launched
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace tg::backend {

// Note [launch watch]
// A CUDA graph replays its kernels with the arguments they had when it was captured: a pointer, a shape, a
// scalar such as the lr or dropout's Philox offset, baked in. A step that passes another value on the next
// call cannot be replayed as a graph unless that value reaches its kernel through memory instead (a device
// pointer written before the launch). Every op launches its kernels through TG_BACKEND (Note [backend
// dispatch]), and on either device that goes through Watched<&kernel>: with no watcher installed (the normal case)
// it costs one thread-local load and calls the kernel; with one, it first reports the launch: the kernel's
// name, one 64-bit hash of each argument's value, and whether the kernel returns a value to its caller (on a
// GPU: a read of the device, which a graph cannot make). An argument's hash is of its value as the kernel sees
// it: a pointer's address (not what it points to), a number's bits, a shape's extents, a string's characters,
// a class's watch_fields() (a tuple of its fields, for a class that is not an aggregate),
// a span's address and length, an aggregate's fields one by one (its padding is never read), a fixed array's
// elements, a padding-free object's bytes (bf16, fp16). So two launches of the same kernel with equal hashes bake the same arguments, and the compiled
// step's graph report (CompileOptions::watch_launches, Note [graph blockers]) compares its launches from one
// replay to the next. What a hash cannot see: the bytes behind a pointer (a multi-tensor kernel's table of
// pointers lives in a host array whose address is stable while its contents could change; the CUDA launchers
// copy such tables to the device at each launch, Note [graph blockers]) and work the host does outside a kernel.
// The helpers called outside TG_BACKEND report themselves with report_launch (the host boundary's sums and
// scaling, the scaler's unscale, the weight copies' refresh, fills, fused chains, with their tables' contents;
// on CUDA also the multi-tensor norm, rescale and unscale with their tables' contents, tg::pointwise's generated
// kernels, and the runtime's copies: an upload with the staging block it reads, a download as a read).

/// One kernel launch as a watcher sees it.
struct Launch {
  const char* kernel = "";                  ///< the kernel's name in its family list
  const std::uint64_t* args = nullptr;      ///< one hash per argument
  int arity = 0;
  bool returns_value = false;               ///< the kernel hands its caller a value (a read of the device)
};

/// Told of every CPU kernel launched on the thread it is installed on (LaunchWatchScope).
class LaunchWatcher {
 public:
  virtual ~LaunchWatcher() = default;
  virtual void on_launch(const Launch& launch) = 0;
};

/// The calling thread's watcher (null: none, the normal case).
inline LaunchWatcher*& launch_watcher() {
  thread_local LaunchWatcher* w = nullptr;
  return w;
}

/// Installs a watcher on the calling thread for the scope (restoring the previous one).
class LaunchWatchScope {
 public:
  explicit LaunchWatchScope(LaunchWatcher* w) : previous_(launch_watcher()) { launch_watcher() = w; }
  ~LaunchWatchScope() { launch_watcher() = previous_; }
  LaunchWatchScope(const LaunchWatchScope&) = delete;
  LaunchWatchScope& operator=(const LaunchWatchScope&) = delete;

 private:
  LaunchWatcher* previous_;
};

namespace watch {
inline constexpr std::uint64_t kSeed = 0xcbf29ce484222325ull;
inline std::uint64_t mix(std::uint64_t h, std::uint64_t v) {  // FNV-1a over v's 8 bytes
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xffu)) * 0x100000001b3ull;
  return h;
}

/// Converts to any type: counts an aggregate's fields (how many of these its braced initialization takes; an
/// array member takes one per element, so an aggregate with arrays names its fields with watch_fields()).
struct AnyField {
  template <class X>
  operator X() const;  // never defined: used in unevaluated contexts only
};
template <class S, class... A>
constexpr std::size_t field_count() {
  if constexpr (requires { S{A{}..., AnyField{}}; }) return field_count<S, A..., AnyField>();
  else return sizeof...(A);
}

template <class X>
std::uint64_t hash(std::uint64_t h, const X& x);

template <class S>
std::uint64_t fields(std::uint64_t h, const S& s) {
  constexpr std::size_t n = field_count<S>();
  static_assert(n <= 12, "launch watch: an aggregate kernel argument with more than 12 fields (add a case)");
  auto fold = [&h](const auto&... f) { ((h = hash(h, f)), ...); };
  if constexpr (n == 0) {
  }
#define TG_WATCH_FIELDS_(N, ...)   \
  else if constexpr (n == N) {     \
    const auto& [__VA_ARGS__] = s; \
    fold(__VA_ARGS__);             \
  }
  TG_WATCH_FIELDS_(1, a)
  TG_WATCH_FIELDS_(2, a, b)
  TG_WATCH_FIELDS_(3, a, b, c)
  TG_WATCH_FIELDS_(4, a, b, c, d)
  TG_WATCH_FIELDS_(5, a, b, c, d, e)
  TG_WATCH_FIELDS_(6, a, b, c, d, e, g)
  TG_WATCH_FIELDS_(7, a, b, c, d, e, g, i)
  TG_WATCH_FIELDS_(8, a, b, c, d, e, g, i, j)
  TG_WATCH_FIELDS_(9, a, b, c, d, e, g, i, j, k)
  TG_WATCH_FIELDS_(10, a, b, c, d, e, g, i, j, k, l)
  TG_WATCH_FIELDS_(11, a, b, c, d, e, g, i, j, k, l, m)
  TG_WATCH_FIELDS_(12, a, b, c, d, e, g, i, j, k, l, m, o)
#undef TG_WATCH_FIELDS_
  return h;
}

/// h extended by x's value (Note [launch watch]).
template <class X>
std::uint64_t hash(std::uint64_t h, const X& x) {
  using V = std::remove_cvref_t<X>;
  if constexpr (std::is_null_pointer_v<V>) {
    return mix(h, 0);
  } else if constexpr (std::is_pointer_v<V>) {
    return mix(h, static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(x)));
  } else if constexpr (std::is_enum_v<V>) {
    return mix(h, static_cast<std::uint64_t>(static_cast<std::underlying_type_t<V>>(x)));
  } else if constexpr (std::is_integral_v<V>) {
    return mix(h, static_cast<std::uint64_t>(x));
  } else if constexpr (std::is_floating_point_v<V>) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &x, sizeof x);
    return mix(h, bits);
  } else if constexpr (std::is_array_v<V>) {
    for (const auto& e : x) h = hash(h, e);
    return h;
  } else if constexpr (std::is_convertible_v<const V&, std::string_view>) {
    const std::string_view s(x);
    h = mix(h, s.size());
    for (char c : s) h = mix(h, static_cast<unsigned char>(c));
    return h;
  } else if constexpr (requires { x.data(); x.size(); x.extent; }) {  // std::span: where it points, how far
    return mix(mix(h, static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(x.data()))), x.size());
  } else if constexpr (requires { x.begin(); x.end(); x.size(); }) {  // Shape and other ranges: their values
    h = mix(h, static_cast<std::uint64_t>(x.size()));
    for (const auto& e : x) h = hash(h, e);
    return h;
  } else if constexpr (requires { x.watch_fields(); }) {  // a class with constructors names its fields (a tuple of refs)
    std::apply([&h](const auto&... f) { ((h = hash(h, f)), ...); }, x.watch_fields());
    return h;
  } else if constexpr (std::has_unique_object_representations_v<V>) {  // bf16, fp16: no padding, so their bytes
    unsigned char bytes[sizeof(V)];
    std::memcpy(bytes, &x, sizeof(V));
    for (unsigned char c : bytes) h = mix(h, c);
    return h;
  } else if constexpr (std::is_aggregate_v<V>) {
    return fields(h, x);
  } else {
    static_assert(std::is_aggregate_v<V>, "launch watch: a kernel argument type it cannot hash (add a case)");
    return h;
  }
}
}  // namespace watch

/// Reports a launch of `kernel` with these argument values to the calling thread's watcher, if any: for a CPU
/// kernel called outside TG_BACKEND (a host boundary's sums, a fused chain, a fill), or whose arguments are
/// better seen by value (a chain's table of operand pointers: its contents, not its address). Note [launch watch].
template <class... A>
void report_launch(const char* kernel, bool returns_value, const A&... a) {
  if (LaunchWatcher* w = launch_watcher()) [[unlikely]] {
    const std::array<std::uint64_t, sizeof...(A) + 1> hashes{watch::hash(watch::kSeed, a)..., 0};
    w->on_launch(Launch{kernel, hashes.data(), static_cast<int>(sizeof...(A)), returns_value});
  }
}

/// A CPU kernel called through the launch watch (Note [launch watch]): TG_BACKEND's CPU branch calls
/// watched::<kernel><T>, an object of this type, with the kernel's own parameter types.
template <auto F>
struct Watched;
template <class R, class... P, R (*F)(P...)>
struct Watched<F> {
  const char* name;
  R operator()(P... p) const {
    if (LaunchWatcher* w = launch_watcher()) [[unlikely]] {
      const std::array<std::uint64_t, sizeof...(P) + 1> hashes{watch::hash(watch::kSeed, p)..., 0};
      w->on_launch(Launch{name, hashes.data(), static_cast<int>(sizeof...(P)), !std::is_void_v<R>});
    }
    return F(std::forward<P>(p)...);
  }
};

}  // namespace tg::backend
