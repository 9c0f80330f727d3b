// safetensors parsing and writing, CRC32C, atomic file replacement (see typegrad/io/safetensors.hpp).
#include "typegrad/io/safetensors.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tg::io {

using json = nlohmann::json;

// ---- dtypes -----------------------------------------------------------------------------------------
std::optional<DType> dtype_from_safetensors_name(std::string_view name) {
#define TG_X(type, e, pname, st) \
  if (name == st) return DType::e;
  TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
  return std::nullopt;
}

// ---- CRC32C -----------------------------------------------------------------------------------------
namespace {
constexpr std::uint32_t kCrc32cPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

// tables[k][b]: the CRC of byte b followed by k zero bytes (slicing-by-8).
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c >> 1) ^ ((c & 1u) ? kCrc32cPoly : 0u);
    t[0][b] = c;
  }
  for (int k = 1; k < 8; ++k)
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xffu];
  return t;
}
constexpr auto kCrcTables = make_crc_tables();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t crc32c_sse42(const void* data, std::size_t n, std::uint32_t crc) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::uint64_t c = ~crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return ~c32;
}
#endif
}  // namespace

namespace detail {
std::uint32_t crc32c_portable(const void* data, std::size_t n, std::uint32_t crc) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::uint32_t c = ~crc;
  while (n >= 8) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = kCrcTables[7][lo & 0xffu] ^ kCrcTables[6][(lo >> 8) & 0xffu] ^ kCrcTables[5][(lo >> 16) & 0xffu] ^
        kCrcTables[4][lo >> 24] ^ kCrcTables[3][hi & 0xffu] ^ kCrcTables[2][(hi >> 8) & 0xffu] ^
        kCrcTables[1][(hi >> 16) & 0xffu] ^ kCrcTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ kCrcTables[0][(c ^ *p++) & 0xffu];
  return ~c;
}
bool crc32c_hardware_available() {
#if defined(__x86_64__)
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
#else
  return false;
#endif
}
}  // namespace detail

std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc) {
#if defined(__x86_64__)
  if (detail::crc32c_hardware_available()) return crc32c_sse42(data, n, crc);
#endif
  return detail::crc32c_portable(data, n, crc);
}

namespace {
std::string hex8(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// ---- parsing ------------------------------------------------------------------------------------------
[[noreturn]] void fail(const std::string& origin, const std::string& what) {
  throw Error("safetensors: ", origin, ": ", what);
}

std::uint64_t read_u64_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/// A non-negative JSON integer, or an error naming `what`.
std::uint64_t json_uint(const json& v, const std::string& origin, const std::string& what) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer()) {
    const auto s = v.get<std::int64_t>();
    if (s >= 0) return static_cast<std::uint64_t>(s);
    fail(origin, what + " is negative (" + std::to_string(s) + ")");
  }
  fail(origin, what + " must be a non-negative integer, got " + v.dump());
}

constexpr int kMaxJsonDepth = 8;
}  // namespace

SafetensorsReader SafetensorsReader::open(const std::string& path) {
  return parse(read_file_bytes(path), path);
}

SafetensorsReader SafetensorsReader::parse(std::vector<std::uint8_t> bytes, std::string origin) {
  SafetensorsReader r;
  r.path_ = std::move(origin);
  r.file_ = std::move(bytes);
  const std::string& o = r.path_;
  const std::uint64_t size = r.file_.size();
  if (size < 8) fail(o, "truncated file: " + std::to_string(size) + " bytes, fewer than the 8-byte header length");
  const std::uint64_t n = read_u64_le(r.file_.data());
  if (n > kMaxHeaderBytes)
    fail(o, "header length " + std::to_string(n) + " exceeds the maximum of " + std::to_string(kMaxHeaderBytes) +
                " bytes (corrupt or not a safetensors file)");
  if (n > size - 8)
    fail(o, "truncated file: the header length is " + std::to_string(n) + " bytes but only " +
                std::to_string(size - 8) + " bytes follow the length field");
  if (n < 2) fail(o, "header length " + std::to_string(n) + " is too small for a JSON object");
  const char* hb = reinterpret_cast<const char*>(r.file_.data() + 8);
  if (hb[0] != '{') fail(o, "the header does not start with '{' (not a safetensors file?)");
  r.data_start_ = 8 + n;
  const std::uint64_t data_size = size - r.data_start_;

  // Parse with a callback that rejects duplicate keys (at any level) and deep nesting.
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) -> bool {
    if (depth > kMaxJsonDepth) fail(o, "the header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    switch (ev) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        break;
      default: break;
    }
    return true;
  };
  json h;
  try {
    h = json::parse(hb, hb + n, cb);
  } catch (const json::exception& e) {
    fail(o, std::string("the header is not valid JSON: ") + e.what());
  }
  if (!duplicate.empty()) fail(o, "the header repeats the key '" + duplicate + "'");
  if (!h.is_object()) fail(o, "the header is not a JSON object");

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) fail(o, "__metadata__ must be an object of strings, got " + std::string(v.type_name()));
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(o, "__metadata__ entry '" + m.key() + "' must be a string, got " + std::string(m.value().type_name()));
        r.metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string what = "tensor '" + key + "'";
    if (key.empty()) fail(o, "a tensor has an empty name");
    if (!v.is_object()) fail(o, what + ": entry must be an object, got " + std::string(v.type_name()));
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        fail(o, what + ": unknown field '" + f.key() + "' (expected dtype, shape, data_offsets)");
    if (!v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      fail(o, what + ": entry needs dtype, shape and data_offsets");
    TensorInfo t;
    t.name = key;
    if (!v["dtype"].is_string()) fail(o, what + ": dtype must be a string");
    const auto dt = dtype_from_safetensors_name(v["dtype"].get<std::string>());
    if (!dt) fail(o, what + ": unsupported dtype '" + v["dtype"].get<std::string>() + "' (expected F64, F32, F16, BF16, I64, I32 or U8)");
    t.dtype = *dt;
    const json& shape = v["shape"];
    if (!shape.is_array()) fail(o, what + ": shape must be an array");
    if (shape.size() > static_cast<std::size_t>(kMaxDims))
      fail(o, what + ": shape has " + std::to_string(shape.size()) + " dimensions, at most " + std::to_string(kMaxDims) +
                  " are supported");
    std::uint64_t numel = 1;
    bool overflow = false;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const std::uint64_t dim = json_uint(shape[d], o, what + ": shape[" + std::to_string(d) + "]");
      if (dim > static_cast<std::uint64_t>(INT64_MAX)) fail(o, what + ": shape[" + std::to_string(d) + "] is too large");
      t.shape.push_back(static_cast<std::int64_t>(dim));
      overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
    }
    std::uint64_t expected = 0;
    overflow = overflow || __builtin_mul_overflow(numel, static_cast<std::uint64_t>(dtype_size(t.dtype)), &expected);
    if (overflow) fail(o, what + ": shape " + shape.dump() + " overflows the byte count");
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) fail(o, what + ": data_offsets must be an array of two integers");
    t.begin = json_uint(off[0], o, what + ": data_offsets[0]");
    t.end = json_uint(off[1], o, what + ": data_offsets[1]");
    if (t.begin > t.end)
      fail(o, what + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "] end before they begin");
    if (t.end > data_size)
      fail(o, what + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) +
                  "] run past the end of the data (" + std::to_string(data_size) + " bytes; truncated file?)");
    if (t.end - t.begin != expected)
      fail(o, what + ": shape " + to_string(t.shape) + " of " + std::string(dtype_safetensors_name(t.dtype)) + " needs " +
                  std::to_string(expected) + " bytes, data_offsets give " + std::to_string(t.end - t.begin));
    r.tensors_.push_back(std::move(t));
  }

  // The tensors must tile [0, data_size) exactly.
  std::sort(r.tensors_.begin(), r.tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t at = 0;
  const TensorInfo* prev = nullptr;
  for (const TensorInfo& t : r.tensors_) {
    if (t.begin < at)
      fail(o, "tensor '" + t.name + "' (bytes " + std::to_string(t.begin) + ".." + std::to_string(t.end) +
                  ") overlaps tensor '" + prev->name + "' (bytes " + std::to_string(prev->begin) + ".." +
                  std::to_string(prev->end) + ")");
    if (t.begin > at)
      fail(o, "the data has a hole: bytes " + std::to_string(at) + ".." + std::to_string(t.begin) +
                  " belong to no tensor (before tensor '" + t.name + "')");
    at = t.end;
    prev = &t;
  }
  if (at != data_size)
    fail(o, "the data has " + std::to_string(data_size - at) + " bytes after the last tensor that belong to no tensor");
  for (std::size_t i = 0; i < r.tensors_.size(); ++i) r.index_[r.tensors_[i].name] = i;
  return r;
}

void SafetensorsReader::verify_checksums(bool required) const {
  auto it = metadata_.find("tg.crc32c");
  if (it == metadata_.end()) {
    if (required) fail(path_, "no checksums (metadata entry \"tg.crc32c\" is missing)");
    return;
  }
  json sums;
  try {
    sums = json::parse(it->second);
  } catch (const json::exception& e) {
    fail(path_, std::string("metadata \"tg.crc32c\" is not valid JSON: ") + e.what());
  }
  if (!sums.is_object()) fail(path_, "metadata \"tg.crc32c\" must be a JSON object");
  for (auto s = sums.begin(); s != sums.end(); ++s) {
    if (!contains(s.key())) fail(path_, "metadata \"tg.crc32c\" lists tensor '" + s.key() + "', which the file does not hold");
    if (!s.value().is_string()) fail(path_, "the checksum of tensor '" + s.key() + "' is not a string");
  }
  for (const TensorInfo& t : tensors_) {
    if (!sums.contains(t.name)) fail(path_, "tensor '" + t.name + "' has no checksum in metadata \"tg.crc32c\"");
    const std::string want = sums[t.name].get<std::string>();
    const std::string got = hex8(crc32c(file_.data() + data_start_ + t.begin, static_cast<std::size_t>(t.nbytes())));
    if (want != got)
      fail(path_, "checksum mismatch for tensor '" + t.name + "': stored crc32c " + want + ", the data gives " + got +
                      " (the file is corrupt)");
  }
}

// ---- writing ----------------------------------------------------------------------------------------
void SafetensorsWriter::add_span(const std::string& name, DType dtype, const Shape& shape, const void* data,
                                 std::size_t nbytes, std::shared_ptr<const void> keep_alive) {
  TG_CHECK(!name.empty() && name != "__metadata__", "SafetensorsWriter::add: invalid tensor name '", name, "'");
  for (const Entry& e : entries_) TG_CHECK(e.name != name, "SafetensorsWriter::add: tensor '", name, "' added twice");
  TG_CHECK(static_cast<std::uint64_t>(shape.numel()) * dtype_size(dtype) == nbytes, "SafetensorsWriter::add: tensor '",
           name, "' of shape ", shape, " and dtype ", dtype_safetensors_name(dtype), " needs ",
           static_cast<std::uint64_t>(shape.numel()) * dtype_size(dtype), " bytes, got ", nbytes);
  entries_.push_back({name, dtype, shape, data, nbytes, std::move(keep_alive)});
}

void SafetensorsWriter::add_bytes(const std::string& name, DType dtype, const Shape& shape, std::vector<std::uint8_t> bytes) {
  auto owned = std::make_shared<std::vector<std::uint8_t>>(std::move(bytes));
  add_span(name, dtype, shape, owned->data(), owned->size(), owned);
}

std::string SafetensorsWriter::header() const {
  try {
    return header_text();
  } catch (const json::exception& e) {  // a name or metadata value that is not valid UTF-8
    throw Error("SafetensorsWriter: a tensor name or metadata entry is not valid UTF-8: ", e.what());
  }
}

std::string SafetensorsWriter::header_text() const {
  json h = json::object();
  json meta = json::object();
  for (const auto& [k, v] : metadata_) meta[k] = v;
  if (checksums_) {
    json sums = json::object();
    for (const Entry& e : entries_) sums[e.name] = hex8(crc32c(e.data, e.nbytes));
    meta["tg.crc32c"] = sums.dump();
  }
  if (!meta.empty()) h["__metadata__"] = meta;
  std::uint64_t at = 0;
  for (const Entry& e : entries_) {
    json shape = json::array();
    for (auto d : e.shape) shape.push_back(d);
    h[e.name] = {{"dtype", std::string(dtype_safetensors_name(e.dtype))}, {"shape", shape}, {"data_offsets", {at, at + e.nbytes}}};
    at += e.nbytes;
  }
  std::string s = h.dump();
  s.append((8 - s.size() % 8) % 8, ' ');  // the data starts 8-byte aligned (8 + N is a multiple of 8)
  return s;
}

void SafetensorsWriter::emit(const std::function<void(const void*, std::size_t)>& sink) const {
  const std::string h = header();
  std::uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(h.size()) >> (8 * i));
  sink(len, 8);
  sink(h.data(), h.size());
  for (const Entry& e : entries_)
    if (e.nbytes > 0) sink(e.data, e.nbytes);
}

std::vector<std::uint8_t> SafetensorsWriter::serialize() const {
  std::vector<std::uint8_t> out;
  emit([&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  });
  return out;
}

void SafetensorsWriter::write(const std::string& path) const {
  std::uint64_t total = 0;
  for (const Entry& e : entries_) total += e.nbytes;
  write_file_atomic(path, [&](const std::function<void(const void*, std::size_t)>& sink) { emit(sink); }, total);
}

// ---- files ------------------------------------------------------------------------------------------
std::vector<std::uint8_t> read_file_bytes(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(what, ": ", path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(what, ": ", path, ": not a regular file");
  }
  std::vector<std::uint8_t> out(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t k = ::read(fd, out.data() + done, out.size() - done);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      const int err = errno;
      ::close(fd);
      throw Error(what, ": ", path, ": read failed: ", std::strerror(err));
    }
    if (k == 0) break;  // the file shrank while being read
    done += static_cast<std::size_t>(k);
  }
  ::close(fd);
  out.resize(done);
  return out;
}

namespace {
std::atomic<int> g_atomic_writes{0};

/// The test hook of Note [atomic file replacement]: pauses (forever) at `stage` when asked to.
void maybe_pause_for_test(const char* stage, int write_index) {
  const char* want = std::getenv("TG_IO_TEST_PAUSE");
  if (!want || std::strcmp(want, stage) != 0) return;
  const char* at = std::getenv("TG_IO_TEST_PAUSE_AT");
  if (write_index != (at ? std::atoi(at) : 1)) return;
  if (const char* marker = std::getenv("TG_IO_TEST_PAUSE_MARKER")) {
    if (FILE* f = std::fopen(marker, "w")) {
      std::fprintf(f, "%s\n", stage);
      std::fclose(f);
    }
  }
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

void fsync_dir(const std::string& dir, const std::string& path) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw Error("write_file_atomic: ", path, ": cannot open directory '", dir, "': ", std::strerror(errno));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  if (rc != 0 && err != EINVAL) throw Error("write_file_atomic: ", path, ": fsync of directory '", dir, "' failed: ", std::strerror(err));
}
}  // namespace

void write_file_atomic(const std::string& path,
                       const std::function<void(const std::function<void(const void*, std::size_t)>&)>& body,
                       std::uint64_t total_bytes) {
  const auto slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  TG_CHECK(!base.empty(), "write_file_atomic: '", path, "' names a directory, not a file");
  const int index = ++g_atomic_writes;
  const std::string tmp = dir + "/." + base + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(index);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw Error("write_file_atomic: ", path, ": cannot create '", tmp, "': ", std::strerror(errno));
  auto cleanup = [&](const std::string& why) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw Error("write_file_atomic: ", path, ": ", why);
  };
  std::uint64_t written = 0;
  bool paused_mid = false;
  auto sink = [&](const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    while (n > 0) {
      std::size_t chunk = n;
      // Stop exactly half-way through the payload for the mid-write hook.
      if (!paused_mid && total_bytes > 0 && written < total_bytes / 2 && written + chunk > total_bytes / 2)
        chunk = static_cast<std::size_t>(total_bytes / 2 - written);
      const ssize_t k = ::write(fd, b, chunk);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) throw Error("write_file_atomic: ", path, ": write to '", tmp, "' failed: ", std::strerror(errno));
      b += k;
      n -= static_cast<std::size_t>(k);
      written += static_cast<std::uint64_t>(k);
      if (!paused_mid && total_bytes > 0 && written >= total_bytes / 2) {
        paused_mid = true;
        maybe_pause_for_test("mid-write", index);
      }
    }
  };
  try {
    body(sink);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::fsync(fd) != 0) cleanup(std::string("fsync of '") + tmp + "' failed: " + std::strerror(errno));
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error("write_file_atomic: ", path, ": close of '", tmp, "' failed: ", std::strerror(err));
  }
  maybe_pause_for_test("before-rename", index);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw Error("write_file_atomic: ", path, ": rename of '", tmp, "' failed: ", std::strerror(err));
  }
  fsync_dir(dir, path);
}

}  // namespace tg::io
