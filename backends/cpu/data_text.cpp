// Text reading, the fortunes corpus and TextDataset's split (include/typegrad/data/dataset.hpp).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "typegrad/data/dataset.hpp"

namespace tg::data {

namespace fs = std::filesystem;

std::string read_text_file(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw Error("read_text_file: '", path.string(), "' does not exist");
  if (fs::is_directory(path, ec))
    throw Error("read_text_file: '", path.string(), "' is a directory, expected a file (use read_text_directory)");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("read_text_file: cannot open '", path.string(), "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error("read_text_file: error reading '", path.string(), "'");
  std::string text = ss.str();
  if (text.empty()) throw Error("read_text_file: '", path.string(), "' is empty");
  return text;
}

std::string read_text_files(const std::vector<fs::path>& paths) {
  TG_CHECK(!paths.empty(), "read_text_files: the list of files is empty");
  std::string out;
  for (const auto& p : paths) out += read_text_file(p);
  return out;
}

std::vector<fs::path> list_text_files(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) throw Error("list_text_files: directory '", dir.string(), "' does not exist");
  if (!fs::is_directory(dir, ec)) throw Error("list_text_files: '", dir.string(), "' is not a directory");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    if (e.is_regular_file()) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_text_directory(const fs::path& dir) {
  const auto files = list_text_files(dir);
  if (files.empty()) throw Error("read_text_directory: directory '", dir.string(), "' holds no files");
  return read_text_files(files);
}

namespace {
std::string fortunes_missing(const fs::path& dir, const char* what) {
  return Error::concat("fortunes corpus: ", dir.string(), " ", what,
                       "; install Debian's `fortunes` package (apt-get install fortunes) or pass another corpus");
}
}  // namespace

std::vector<fs::path> fortune_files(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(fortunes_missing(dir, "does not exist"));
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const fs::path& p = e.path();
    // Regular files only (symlinks such as the .u8 ones are resolved by is_regular_file, so filter by
    // extension too); no subdirectories ("off").
    if (!e.is_regular_file() || p.has_extension() || p.filename().string().starts_with(".")) continue;
    files.push_back(p);
  }
  if (files.empty()) throw Error(fortunes_missing(dir, "holds no fortune files"));
  std::sort(files.begin(), files.end());
  return files;
}

std::string strip_fortune_separators(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  std::size_t pos = 0;
  bool pending_blank = false;  // a separator seen; emit the empty line before the next fortune's text
  while (pos < text.size()) {
    std::size_t eol = text.find('\n', pos);
    const bool has_nl = eol != std::string_view::npos;
    if (!has_nl) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = has_nl ? eol + 1 : text.size();
    std::string_view bare = line;
    if (!bare.empty() && bare.back() == '\r') bare.remove_suffix(1);
    if (bare == "%") {
      pending_blank = !out.empty();
      continue;
    }
    if (pending_blank) {
      out += '\n';
      pending_blank = false;
    }
    out += line;
    out += '\n';
  }
  return out;
}

std::string load_fortunes_corpus(const fs::path& dir) {
  std::string out;
  for (const auto& p : fortune_files(dir)) {
    const std::string text = read_text_file(p);
    if (!out.empty()) out += '\n';  // files are separated like fortunes, by one empty line
    out += strip_fortune_separators(text);
  }
  return out;
}

// ---- TextDataset ------------------------------------------------------------------------------------

TextDataset::TextDataset(std::vector<std::int32_t> tokens, double val_fraction, std::int64_t context, std::string source)
    : val_fraction_(val_fraction), source_(std::move(source)) {
  TG_CHECK(!tokens.empty(), "TextDataset: ", source_, " has no tokens");
  TG_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "TextDataset: ", source_, ": val_fraction must be in [0, 1), got ",
           val_fraction);
  TG_CHECK(context >= 0, "TextDataset: ", source_, ": context must be >= 0, got ", context);
  const auto n = static_cast<std::int64_t>(tokens.size());
  const auto n_val = static_cast<std::int64_t>(std::floor(static_cast<double>(n) * val_fraction));
  train_size_ = n - n_val;
  tokens_ = std::make_shared<const std::vector<std::int32_t>>(std::move(tokens));
  if (context > 0) require_context(context);
}

void TextDataset::require_context(std::int64_t context) const {
  TG_CHECK(context > 0, "TextDataset::require_context: context must be > 0, got ", context);
  auto check = [&](const char* name, std::int64_t size) {
    TG_CHECK(size >= context + 1, "TextDataset: ", source_, ": the ", name, " split has ", size,
             " tokens, fewer than context + 1 = ", context + 1, " (stream of ", this->size(),
             " tokens, val_fraction ", val_fraction_, ")");
  };
  check("train", train_size_);
  if (val_fraction_ > 0.0) check("validation", val_size());
}

}  // namespace tg::data
