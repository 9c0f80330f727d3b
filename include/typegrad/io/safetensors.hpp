// safetensors files: a little-endian u64 header length N, N bytes of JSON header (per tensor: dtype,
// shape, data_offsets; "__metadata__": string -> string), then the tensor bytes. Reader validates all of it.
//   tg::io::SafetensorsWriter w;  w.add("wte.weight", wte);  w.set_metadata("format", "pt");  w.write("m.safetensors");
//   auto r = tg::io::SafetensorsReader::open("m.safetensors");  tg::Tensor<tg::fp32> t = r.get<tg::fp32>("wte.weight");
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/core/tensor.hpp"

namespace tg::io {

static_assert(std::endian::native == std::endian::little,
              "typegrad's safetensors code copies tensor bytes as they are: it needs a little-endian host");

// Note [safetensors validation]
// A file is accepted only when all of this holds (anything else throws tg::Error "safetensors: <file>:
// <problem>", before any tensor byte is read):
//   * at least 8 bytes; the header length N satisfies 2 <= N <= kMaxHeaderBytes and 8 + N <= file size;
//   * the header is UTF-8 JSON starting with '{' (trailing spaces allowed), an object without duplicate
//     keys at any level and nested at most 8 deep;
//   * "__metadata__", when present, is an object of string values;
//   * every other key is a non-empty tensor name mapping to exactly {dtype, shape, data_offsets}: dtype one
//     of the master list's names (F64 F32 F16 BF16 I64 I32 U8 I8), shape at most kMaxDims non-negative
//     integers, data_offsets two integers begin <= end;
//   * end - begin == numel(shape) * size(dtype), computed without overflow;
//   * sorted by offset, the tensors tile the data section exactly: no overlap, no hole, no byte after the
//     last tensor, no offset past the end of the file.
// Checksums (Note [checksums]) are checked on demand: verify_checksums(), and by every typegrad loader.

/// The largest header accepted (100 MiB); a larger one is refused before it is read.
inline constexpr std::uint64_t kMaxHeaderBytes = 100ull << 20;

/// A tensor's entry in the header. begin/end are byte offsets into the data section (after the header).
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t nbytes() const { return end - begin; }
};

/// The dtype named `name` in safetensors spelling ("F32", "BF16", ...), or nothing.
std::optional<DType> dtype_from_safetensors_name(std::string_view name);

// Note [checksums]
// Files written by typegrad carry a CRC32C (Castagnoli polynomial 0x1EDC6F41, reflected 0x82F63B78;
// check value crc32c("123456789") = 0xE3069283) of every tensor's bytes in the metadata entry
// "tg.crc32c", a JSON object {"<tensor>": "<8 lowercase hex digits>"}. Files from other writers have
// none; verify_checksums(false) accepts that, verify_checksums(true) does not. The CRC uses the SSE4.2
// crc32 instruction when the CPU has it and a slicing-by-8 table otherwise (tests check both agree).

/// CRC32C of n bytes, continuing from `crc` (0 to start).
std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0);
namespace detail {
std::uint32_t crc32c_portable(const void* data, std::size_t n, std::uint32_t crc);  // the table version
bool crc32c_hardware_available();
}  // namespace detail

/// A parsed, validated safetensors file held in memory.
class SafetensorsReader {
 public:
  /// Reads and validates the file at `path`.
  static SafetensorsReader open(const std::string& path);
  /// Validates `bytes`; `origin` names them in messages (a path, "<fuzz input>").
  static SafetensorsReader parse(std::vector<std::uint8_t> bytes, std::string origin);

  const std::string& path() const { return path_; }
  /// Every tensor, in data-offset order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::optional<std::string> metadata_value(const std::string& key) const {
    auto it = metadata_.find(key);
    if (it == metadata_.end()) return std::nullopt;
    return it->second;
  }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  /// The entry of `name`; throws naming the file and the tensor when there is none.
  const TensorInfo& info(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error("safetensors: ", path_, ": no tensor named '", name, "'");
    return tensors_[it->second];
  }
  /// The raw little-endian bytes of `name`.
  std::span<const std::uint8_t> bytes(const std::string& name) const {
    const TensorInfo& t = info(name);
    return {file_.data() + data_start_ + t.begin, static_cast<std::size_t>(t.nbytes())};
  }

  /// A copy of `name` as a Tensor<T>; its dtype must be T's.
  template <Element T>
  Tensor<T> get(const std::string& name) const {
    const TensorInfo& t = info(name);
    TG_CHECK(t.dtype == dtype_traits<T>::dtype, "safetensors: ", path_, ": tensor '", name, "' has dtype ",
             dtype_safetensors_name(t.dtype), ", expected ", dtype_safetensors_name(dtype_traits<T>::dtype));
    Tensor<T> out = Tensor<T>::empty(t.shape);
    if (t.nbytes() > 0) std::memcpy(out.data(), file_.data() + data_start_ + t.begin, static_cast<std::size_t>(t.nbytes()));
    return out;
  }
  /// A copy of floating tensor `name` converted to T (fp16/bf16 through fp32, round-to-nearest-even).
  template <FloatingElement T>
  Tensor<T> get_converted(const std::string& name) const {
    const TensorInfo& t = info(name);
    switch (t.dtype) {
      case DType::f64: return convert<double, T>(t);
      case DType::f32: return convert<float, T>(t);
      case DType::f16: return convert<fp16, T>(t);
      case DType::bf16: return convert<bf16, T>(t);
      default:
        throw Error("safetensors: ", path_, ": tensor '", name, "' has dtype ", dtype_safetensors_name(t.dtype),
                    ", not a floating type convertible to ", dtype_traits<T>::name);
    }
  }

  /// Whether the file carries typegrad's per-tensor checksums (Note [checksums]).
  bool has_checksums() const { return metadata_.count("tg.crc32c") != 0; }
  /// Checks every tensor against its CRC32C; `required`: a file without checksums is an error too.
  void verify_checksums(bool required) const;

 private:
  template <class S, class T>
  Tensor<T> convert(const TensorInfo& t) const {
    Tensor<T> out = Tensor<T>::empty(t.shape);
    const std::uint8_t* src = file_.data() + data_start_ + t.begin;
    T* dst = out.data();
    for (std::int64_t i = 0; i < out.numel(); ++i) {
      S v;
      std::memcpy(&v, src + static_cast<std::size_t>(i) * sizeof(S), sizeof(S));
      dst[i] = scalar_cast<T>(v);
    }
    return out;
  }

  std::string path_;
  std::vector<std::uint8_t> file_;
  std::uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

/// Builds a safetensors file from tensors and metadata. Tensors are referenced, not copied (a
/// non-contiguous one is made contiguous); they must not change until write()/serialize() returns.
class SafetensorsWriter {
 public:
  template <Element T>
  void add(const std::string& name, const Tensor<T, cpu>& t) {
    const Tensor<T, cpu> c = t.is_contiguous() ? t.detach() : t.contiguous_raw();
    add_span(name, dtype_traits<T>::dtype, c.shape(), c.data(), c.nbytes(), c.storage());
  }
  /// Bytes owned by the writer (any dtype; their size must match the shape).
  void add_bytes(const std::string& name, DType dtype, const Shape& shape, std::vector<std::uint8_t> bytes);
  void set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }
  /// Adds "tg.crc32c" (Note [checksums]) on write; on by default.
  void set_checksums(bool on) { checksums_ = on; }
  std::size_t size() const { return entries_.size(); }

  /// The whole file in memory.
  std::vector<std::uint8_t> serialize() const;
  /// Writes the file atomically (write_file_atomic).
  void write(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    const void* data;
    std::size_t nbytes;
    std::shared_ptr<const void> keep_alive;
  };
  void add_span(const std::string& name, DType dtype, const Shape& shape, const void* data, std::size_t nbytes,
                std::shared_ptr<const void> keep_alive);
  std::string header() const;
  std::string header_text() const;
  void emit(const std::function<void(const void*, std::size_t)>& sink) const;

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  bool checksums_ = true;
};

// Note [atomic file replacement]
// write_file_atomic(path, ...) writes "<dir>/.<name>.tmp-<pid>-<n>" (created with O_EXCL, in the same
// directory so rename cannot cross file systems), fsyncs it, renames it over `path` (atomic on POSIX),
// then fsyncs the directory so the rename itself survives a power cut. A crash at any point leaves
// either the old file or the new one under `path`, never a mix; the temporary name never matches a
// checkpoint name, so a half-written file is never picked up. On an error the temporary is removed.
//
// Test hook (tests only; documented in docs/checkpoints.md): with TG_IO_TEST_PAUSE=mid-write or
// before-rename, the TG_IO_TEST_PAUSE_AT-th (default 1st) atomic write of the process stops at that point
// (half of the bytes written / temporary complete and fsynced), creates the file TG_IO_TEST_PAUSE_MARKER
// when set, and sleeps until it is killed. The kill tests use it to SIGKILL a process inside a save.

/// Atomically replaces `path` with the bytes `body` writes through its sink; `total_bytes` (when known)
/// places the mid-write test hook.
void write_file_atomic(const std::string& path,
                       const std::function<void(const std::function<void(const void*, std::size_t)>&)>& body,
                       std::uint64_t total_bytes = 0);
inline void write_file_atomic(const std::string& path, std::span<const std::uint8_t> bytes) {
  write_file_atomic(
      path, [&](const std::function<void(const void*, std::size_t)>& sink) { sink(bytes.data(), bytes.size()); },
      bytes.size());
}
/// The whole file (throws naming the file when it cannot be read).
std::vector<std::uint8_t> read_file_bytes(const std::string& path, const char* what = "safetensors");

}  // namespace tg::io
