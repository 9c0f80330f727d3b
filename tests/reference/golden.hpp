// Reader for golden files (tests/reference/FORMAT.md): named f32 / i64 / f64 arrays written by
// make_goldens.py from PyTorch. Bad files are rejected with a tg::Error naming the file and the problem.
//   auto g = tg::testing::GoldenFile::load("tests/reference/goldens/add.tgg");
//   tg::Tensor<float> x = g.f32("same_shape/x0");  std::vector<double> a = g.f64("same_shape/args");
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <typegrad/typegrad.hpp>

namespace tg::testing {

static_assert(std::endian::native == std::endian::little, "golden.hpp reads little-endian data by memcpy");

inline constexpr char kGoldenMagic[8] = {'T', 'G', 'G', 'O', 'L', 'D', '0', '1'};
inline constexpr std::uint32_t kGoldenMaxNameLength = 4096;

enum class GoldenDType : std::uint8_t { f32 = 1, i64 = 2, f64 = 3 };

inline const char* golden_dtype_name(GoldenDType d) {
  switch (d) {
    case GoldenDType::f32: return "f32";
    case GoldenDType::i64: return "i64";
    case GoldenDType::f64: return "f64";
  }
  return "?";
}
inline std::size_t golden_dtype_size(GoldenDType d) { return d == GoldenDType::f32 ? 4 : 8; }

struct GoldenRecord {
  std::string name;
  GoldenDType dtype = GoldenDType::f32;
  Shape shape;
  std::vector<unsigned char> bytes;  // numel * element size, little-endian
};

class GoldenFile {
 public:
  static GoldenFile load(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw Error("golden: ", path, ": cannot open the file");
    std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return parse(path, bytes);
  }

  /// Parses a whole file's bytes; `path` only names the file in error messages.
  static GoldenFile parse(const std::string& path, std::span<const unsigned char> bytes) {
    GoldenFile f;
    f.path_ = path;
    Cursor c{path, bytes, 0};
    if (bytes.size() < sizeof kGoldenMagic || std::memcmp(bytes.data(), kGoldenMagic, sizeof kGoldenMagic) != 0)
      throw Error("golden: ", path, ": wrong magic (not a TGGOLD01 file)");
    c.pos = sizeof kGoldenMagic;
    const std::uint32_t count = c.u32("the record count");
    for (std::uint32_t r = 0; r < count; ++r) {
      GoldenRecord rec;
      const std::string where = "record " + std::to_string(r);
      const std::uint32_t name_len = c.u32(where + " name length");
      if (name_len == 0 || name_len > kGoldenMaxNameLength)
        throw Error("golden: ", path, ": ", where, ": name length ", name_len, " is not in [1, ", kGoldenMaxNameLength, "]");
      const auto name = c.take(name_len, where + " name");
      rec.name.assign(reinterpret_cast<const char*>(name.data()), name.size());
      const std::string rwhere = where + " ('" + rec.name + "')";
      const std::uint8_t code = c.u8(rwhere + " dtype");
      if (code < 1 || code > 3) throw Error("golden: ", path, ": ", rwhere, ": unknown dtype code ", int(code));
      rec.dtype = static_cast<GoldenDType>(code);
      const std::uint32_t rank = c.u32(rwhere + " rank");
      if (rank > static_cast<std::uint32_t>(kMaxDims))
        throw Error("golden: ", path, ": ", rwhere, ": rank ", rank, " exceeds the maximum of ", kMaxDims);
      std::uint64_t numel = 1;
      for (std::uint32_t d = 0; d < rank; ++d) {
        const std::int64_t dim = c.i64(rwhere + " dims");
        if (dim < 0) throw Error("golden: ", path, ": ", rwhere, ": negative dimension ", dim);
        // dims overflow: the element count (and its byte size) must fit in 63 bits
        if (dim != 0 && numel > (static_cast<std::uint64_t>(INT64_MAX) / 8) / static_cast<std::uint64_t>(dim))
          throw Error("golden: ", path, ": ", rwhere, ": dims overflow (the element count exceeds 2^60)");
        numel *= static_cast<std::uint64_t>(dim);
        rec.shape.push_back(dim);
      }
      const std::uint64_t nbytes = numel * golden_dtype_size(rec.dtype);
      const auto data = c.take(nbytes, rwhere + " data (" + std::to_string(numel) + " " +
                                           golden_dtype_name(rec.dtype) + " elements)");
      rec.bytes.assign(data.begin(), data.end());
      if (f.index_.count(rec.name)) throw Error("golden: ", path, ": ", rwhere, ": duplicate record name");
      f.index_[rec.name] = f.records_.size();
      f.records_.push_back(std::move(rec));
    }
    if (c.pos != bytes.size())
      throw Error("golden: ", path, ": ", bytes.size() - c.pos, " trailing bytes after the last of ", count, " records");
    return f;
  }

  const std::string& path() const { return path_; }
  const std::vector<GoldenRecord>& records() const { return records_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const GoldenRecord& at(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) throw Error("golden: ", path_, ": no record named '", name, "'");
    return records_[it->second];
  }

  Tensor<float> f32(const std::string& name) const {
    const GoldenRecord& r = expect(name, GoldenDType::f32);
    std::vector<float> v(r.bytes.size() / 4);
    if (!v.empty()) std::memcpy(v.data(), r.bytes.data(), r.bytes.size());
    return Tensor<float>::from_vector(r.shape, v);
  }
  Tensor<std::int64_t> i64(const std::string& name) const {
    const GoldenRecord& r = expect(name, GoldenDType::i64);
    std::vector<std::int64_t> v(r.bytes.size() / 8);
    if (!v.empty()) std::memcpy(v.data(), r.bytes.data(), r.bytes.size());
    return Tensor<std::int64_t>::from_vector(r.shape, v);
  }
  /// f64 records (op parameters) as a flat list.
  std::vector<double> f64(const std::string& name) const {
    const GoldenRecord& r = expect(name, GoldenDType::f64);
    std::vector<double> v(r.bytes.size() / 8);
    if (!v.empty()) std::memcpy(v.data(), r.bytes.data(), r.bytes.size());
    return v;
  }

 private:
  struct Cursor {
    const std::string& path;
    std::span<const unsigned char> bytes;
    std::size_t pos;
    std::span<const unsigned char> take(std::uint64_t n, const std::string& what) {
      if (n > bytes.size() - pos)
        throw Error("golden: ", path, ": truncated record: ", what, " needs ", n, " bytes at offset ", pos, ", only ",
                    bytes.size() - pos, " remain");
      auto s = bytes.subspan(pos, static_cast<std::size_t>(n));
      pos += static_cast<std::size_t>(n);
      return s;
    }
    template <class V>
    V scalar(const std::string& what) {
      V v;
      std::memcpy(&v, take(sizeof(V), what).data(), sizeof(V));
      return v;
    }
    std::uint8_t u8(const std::string& w) { return scalar<std::uint8_t>(w); }
    std::uint32_t u32(const std::string& w) { return scalar<std::uint32_t>(w); }
    std::int64_t i64(const std::string& w) { return scalar<std::int64_t>(w); }
  };

  const GoldenRecord& expect(const std::string& name, GoldenDType d) const {
    const GoldenRecord& r = at(name);
    if (r.dtype != d)
      throw Error("golden: ", path_, ": record '", name, "' is ", golden_dtype_name(r.dtype), ", expected ", golden_dtype_name(d));
    return r;
  }

  std::string path_;
  std::vector<GoldenRecord> records_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace tg::testing
