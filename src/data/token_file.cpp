// Token files (include/typegrad/data/token_file.hpp, Note [token files]): writing, mmap-ing and validating.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <vector>

#include "typegrad/data/token_file.hpp"
#include "typegrad/io/safetensors.hpp"

namespace tg::data {

static_assert(std::endian::native == std::endian::little, "token files are little-endian; this reader assumes a little-endian host");

namespace fs = std::filesystem;

namespace {

constexpr int kHeaderInts = static_cast<int>(kTokenFileHeaderBytes / 4);

std::string quoted(const fs::path& p) { return "'" + p.string() + "'"; }

/// A file descriptor closed on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

/// Reads up to n bytes at offset; returns how many were read (short only at the end of the file).
std::size_t pread_full(int fd, void* buf, std::size_t n, off_t offset, const fs::path& path) {
  std::size_t got = 0;
  auto* b = static_cast<char*>(buf);
  while (got < n) {
    const ssize_t k = ::pread(fd, b + got, n - got, offset + static_cast<off_t>(got));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) throw Error("token file ", quoted(path), ": read failed: ", std::strerror(errno));
    if (k == 0) break;
    got += static_cast<std::size_t>(k);
  }
  return got;
}

/// The whole file as a string (the tokenizer sidecar); throws naming `what` and strerror.
std::string read_all(const fs::path& path, const std::string& what) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) throw Error(what, ": cannot open ", quoted(path), ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw Error(what, ": cannot stat ", quoted(path), ": ", std::strerror(errno));
  std::string out(static_cast<std::size_t>(st.st_size), '\0');
  const std::size_t got = pread_full(f.fd, out.data(), out.size(), 0, path);
  out.resize(got);
  return out;
}

/// A read-only shared mapping of a whole file, unmapped when the last stream using it is gone.
struct Mapping {
  void* addr = MAP_FAILED;
  std::size_t length = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (addr != MAP_FAILED) ::munmap(addr, length);
  }
};

/// The printable form of a 4-byte prefix ("hell" or \x..).
std::string show_bytes(const unsigned char* b, std::size_t n) {
  std::string hex, text;
  static const char* digits = "0123456789abcdef";
  for (std::size_t i = 0; i < n; ++i) {
    if (i) hex += ' ';
    hex += digits[b[i] >> 4];
    hex += digits[b[i] & 15];
    text += (b[i] >= 32 && b[i] < 127) ? static_cast<char>(b[i]) : '.';
  }
  return "bytes " + hex + " (\"" + text + "\")";
}

/// The largest id of `n` ids of type S stored at `data` (inside the mapping `m`), scanned in parallel in
/// chunks; each chunk's pages are unmapped from the process (MADV_DONTNEED; they stay in the page cache)
/// once scanned, so the scan adds nothing to the resident set.
template <class S>
S max_id_scan(const Mapping& m, const S* data, std::int64_t n) {
  constexpr std::int64_t kChunkBytes = std::int64_t{8} << 20;  // a multiple of any page size in use
  const auto* base = static_cast<const char*>(m.addr);
  const auto length = static_cast<std::int64_t>(m.length);
  const std::int64_t chunks = (length + kChunkBytes - 1) / kChunkBytes;
  const std::int64_t data_off = reinterpret_cast<const char*>(data) - base;
  S best = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(max : best)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t lo_byte = std::max(c * kChunkBytes, data_off);
    const std::int64_t hi_byte = std::min((c + 1) * kChunkBytes, length);
    const std::int64_t lo = (lo_byte - data_off) / static_cast<std::int64_t>(sizeof(S));
    const std::int64_t hi = std::min(n, (hi_byte - data_off) / static_cast<std::int64_t>(sizeof(S)));
    S m_chunk = 0;
#pragma omp simd reduction(max : m_chunk)
    for (std::int64_t i = lo; i < hi; ++i) m_chunk = data[i] > m_chunk ? data[i] : m_chunk;
    best = m_chunk > best ? m_chunk : best;
    ::madvise(const_cast<char*>(base) + c * kChunkBytes, static_cast<std::size_t>(hi_byte - c * kChunkBytes),
              MADV_DONTNEED);
  }
  return best;
}

template <class S>
std::int64_t first_at_least(const S* data, std::int64_t n, std::int64_t limit) {
  for (std::int64_t i = 0; i < n; ++i)
    if (static_cast<std::int64_t>(data[i]) >= limit) return i;
  return -1;
}

}  // namespace

fs::path token_file_tokenizer_path(const fs::path& path) {
  fs::path p = path;
  p += ".tokenizer.json";
  return p;
}

bool is_token_file(const fs::path& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) return false;
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) return false;
  std::int32_t magic = 0;
  try {
    if (pread_full(f.fd, &magic, 4, 0, path) != 4) return false;
  } catch (const Error&) {
    return false;
  }
  return magic == kTokenFileMagic;
}

// ---- writing ----------------------------------------------------------------------------------------

void write_token_file(const fs::path& path, std::span<const std::int32_t> tokens, std::int64_t vocab_size,
                      std::string_view tokenizer_json) {
  const std::string what = "write_token_file " + quoted(path);
  TG_CHECK(vocab_size >= 1 && vocab_size <= kTokenFileMaxVocab, what, ": vocab_size ", vocab_size,
           " is outside [1, ", kTokenFileMaxVocab, "] (a version-1 token file stores ids as uint16)");
  TG_CHECK(!tokens.empty(), what, ": there are no tokens to write");
  const auto n = static_cast<std::int64_t>(tokens.size());
  TG_CHECK(n <= std::numeric_limits<std::int32_t>::max(), what, ": ", n,
           " tokens do not fit the header's int32 count (at most 2147483647; split the corpus)");
  TG_CHECK(!path.filename().empty(), what, ": the path names a directory, not a file");

  // Every id in [0, vocab_size): a parallel min/max first, the first offender only on failure.
  std::int32_t lo = std::numeric_limits<std::int32_t>::max(), hi = std::numeric_limits<std::int32_t>::min();
  const std::int32_t* t = tokens.data();
#pragma omp parallel for simd reduction(min : lo) reduction(max : hi) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    lo = t[i] < lo ? t[i] : lo;
    hi = t[i] > hi ? t[i] : hi;
  }
  if (lo < 0 || hi >= vocab_size) {
    std::int64_t i = 0;
    while (t[i] >= 0 && t[i] < vocab_size) ++i;
    throw Error(what, ": token ", i, " has id ", t[i], ", outside the vocabulary [0, ", vocab_size, ")");
  }

  std::int32_t header[kHeaderInts] = {};
  header[0] = kTokenFileMagic;
  header[1] = 1;
  header[2] = static_cast<std::int32_t>(n);
  header[3] = static_cast<std::int32_t>(vocab_size);
  header[4] = hi;
  header[5] = tokenizer_json.empty() ? 0 : 1;

  // The sidecar first: a data file that claims a sidecar is never visible without it.
  const fs::path sidecar = token_file_tokenizer_path(path);
  if (!tokenizer_json.empty())
    io::write_file_atomic(sidecar.string(), std::span<const std::uint8_t>(
                                                reinterpret_cast<const std::uint8_t*>(tokenizer_json.data()),
                                                tokenizer_json.size()));
  const std::uint64_t total = static_cast<std::uint64_t>(kTokenFileHeaderBytes) + static_cast<std::uint64_t>(n) * 2;
  io::write_file_atomic(
      path.string(),
      [&](const std::function<void(const void*, std::size_t)>& sink) {
        sink(header, sizeof(header));
        constexpr std::int64_t kChunk = std::int64_t{1} << 20;
        std::vector<std::uint16_t> buf(static_cast<std::size_t>(std::min(n, kChunk)));
        for (std::int64_t at = 0; at < n; at += kChunk) {
          const std::int64_t m = std::min(kChunk, n - at);
          for (std::int64_t i = 0; i < m; ++i) buf[static_cast<std::size_t>(i)] = static_cast<std::uint16_t>(t[at + i]);
          sink(buf.data(), static_cast<std::size_t>(m) * 2);
        }
      },
      total);
  if (tokenizer_json.empty()) {  // a sidecar left by an earlier export would describe other ids
    std::error_code ec;
    fs::remove(sidecar, ec);
  }
}

// ---- reading ----------------------------------------------------------------------------------------

TextDataset TokenFile::dataset(double val_fraction, std::int64_t context) const {
  return TextDataset(stream_, val_fraction, context, "token file " + quoted(path_));
}

TextDataset TextDataset::from_token_file(const fs::path& path, std::int64_t vocab_size, double val_fraction,
                                         std::int64_t context) {
  return open_token_file(path, vocab_size).dataset(val_fraction, context);
}

TokenFile open_token_file(const fs::path& path, std::int64_t vocab_size) {
  const std::string what = "token file " + quoted(path);
  TG_CHECK(vocab_size >= 0 && vocab_size <= std::numeric_limits<std::int32_t>::max(), what,
           ": vocab_size must be in [0, 2^31) (0: the header's), got ", vocab_size);
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error(what, " does not exist");
  if (fs::is_directory(path, ec)) throw Error(what, " is a directory, expected a token file");
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) throw Error(what, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) throw Error(what, ": cannot stat: ", std::strerror(errno));
  const auto file_bytes = static_cast<std::int64_t>(st.st_size);

  // The header, read (not mapped) so that short and empty files are reported before any mmap.
  std::int32_t h[kHeaderInts] = {};
  const std::size_t got = pread_full(f.fd, h, sizeof(h), 0, path);
  if (got < 4 || h[0] != kTokenFileMagic) {
    std::string found = got < 4 ? "only " + std::to_string(got) + " bytes"
                                : "the int32 " + std::to_string(h[0]) + ", " +
                                      show_bytes(reinterpret_cast<const unsigned char*>(h), 4);
    throw Error(what, ": not a token file: expected the magic number ", kTokenFileMagic,
                " as the first little-endian int32 (llm.c's token-file header: 256 int32 of magic, version, token "
                "count, then the ids), found ",
                found);
  }
  if (got < sizeof(h))
    throw Error(what, " is truncated: ", file_bytes, " bytes, shorter than the ", kTokenFileHeaderBytes, "-byte header");

  TokenFileHeader header;
  header.version = h[1];
  TG_CHECK(header.version == 1 || header.version == 2, what, ": version ", header.version,
           " is not supported (expected 1: uint16 ids, or 2: uint32 ids)");
  const std::int64_t width = header.version == 1 ? 2 : 4;
  header.count = h[2];
  TG_CHECK(header.count > 0, what, ": the header's token count is ", header.count, ", expected > 0");
  header.vocab_size = h[3];
  TG_CHECK(header.vocab_size >= 0 && (header.version != 1 || header.vocab_size <= kTokenFileMaxVocab), what,
           ": the header's vocabulary size ", header.vocab_size, " is invalid for a version-", header.version,
           " file (the header is corrupt)");
  header.max_id = header.vocab_size > 0 ? h[4] : -1;
  header.has_tokenizer = h[5] == 1;

  const std::int64_t expected = kTokenFileHeaderBytes + header.count * width;
  if (file_bytes != expected)
    throw Error(what, " is ", file_bytes < expected ? "truncated" : "padded", ": the header's count of ", header.count,
                " tokens of ", width, " bytes needs ", kTokenFileHeaderBytes, " + ", header.count, " x ", width, " = ",
                expected, " bytes, the file has ", file_bytes);

  const std::int64_t vocab = vocab_size > 0 ? vocab_size : header.vocab_size;
  TG_CHECK(vocab > 0, what, " records no vocabulary size (an llm.c file?); pass the vocabulary of the tokenizer it "
           "was written with");

  auto map = std::make_shared<Mapping>();
  map->length = static_cast<std::size_t>(file_bytes);
  map->addr = ::mmap(nullptr, map->length, PROT_READ, MAP_SHARED, f.fd, 0);
  if (map->addr == MAP_FAILED) throw Error(what, ": mmap of ", file_bytes, " bytes failed: ", std::strerror(errno));
  ::madvise(map->addr, map->length, MADV_SEQUENTIAL);
  const void* data = static_cast<const char*>(map->addr) + kTokenFileHeaderBytes;

  std::int64_t max_id = 0;
  if (width == 2) max_id = max_id_scan(*map, static_cast<const std::uint16_t*>(data), header.count);
  else max_id = max_id_scan(*map, static_cast<const std::uint32_t*>(data), header.count);
  ::madvise(map->addr, map->length, MADV_NORMAL);

  const std::string written_for =
      header.vocab_size > 0 ? "the file was written for a vocabulary of " + std::to_string(header.vocab_size) : "";
  if (max_id >= vocab) {
    const std::int64_t pos = width == 2 ? first_at_least(static_cast<const std::uint16_t*>(data), header.count, vocab)
                                        : first_at_least(static_cast<const std::uint32_t*>(data), header.count, vocab);
    const std::int64_t id = width == 2 ? static_cast<const std::uint16_t*>(data)[pos]
                                       : static_cast<const std::uint32_t*>(data)[pos];
    throw Error(what, ": token ", pos, " has id ", id, ", outside the vocabulary of ", vocab, " (",
                header.vocab_size > vocab ? written_for + "; pass the tokenizer it was written with"
                : header.vocab_size > 0   ? written_for + ", so the file is corrupt"
                                          : "pass the tokenizer it was written with",
                ")");
  }
  if (header.vocab_size > vocab)
    throw Error(what, ": ", written_for, ", larger than the vocabulary of ", vocab,
                " given (its ids mean another tokenizer's tokens); pass the tokenizer it was written with");
  if (header.vocab_size > 0 && header.max_id != max_id)
    throw Error(what, ": the header records a largest id of ", header.max_id, " but the tokens' largest is ", max_id,
                " (the file is corrupt)");

  TokenFile tf;
  tf.path_ = path;
  tf.header_ = header;
  tf.vocab_size_ = vocab;
  tf.max_id_ = static_cast<std::int32_t>(max_id);
  const fs::path sidecar = token_file_tokenizer_path(path);
  if (header.has_tokenizer || fs::exists(sidecar, ec))
    tf.tokenizer_json_ = read_all(sidecar, what + ": the tokenizer sidecar");
  tf.stream_ = std::make_shared<const TokenStream>(data, header.count,
                                                   width == 2 ? TokenStream::Kind::uint16 : TokenStream::Kind::uint32,
                                                   std::shared_ptr<const void>(map, map.get()));
  return tf;
}

}  // namespace tg::data
