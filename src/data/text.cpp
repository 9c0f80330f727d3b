// Text reading, the fortunes corpus, TokenStream and TextDataset's split (include/typegrad/data/dataset.hpp),
// and the prefetching sampler's worker (include/typegrad/data/prefetch.hpp).
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "typegrad/data/dataset.hpp"
#include "typegrad/data/prefetch.hpp"

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

// ---- TokenStream ------------------------------------------------------------------------------------

TokenStream::TokenStream(std::vector<std::int32_t> tokens)
    : owned_(std::move(tokens)), data_(owned_.data()), size_(static_cast<std::int64_t>(owned_.size())),
      kind_(Kind::int32) {}

TokenStream::TokenStream(const void* data, std::int64_t n, Kind kind, std::shared_ptr<const void> owner)
    : owner_(std::move(owner)), data_(data), size_(n), kind_(kind) {
  TG_CHECK(kind != Kind::int32, "TokenStream: a view holds uint16 or uint32 ids (an int32 stream owns its vector)");
  TG_CHECK(n >= 0 && (data != nullptr || n == 0), "TokenStream: a view of ", n, " tokens needs data");
}

std::int32_t TokenStream::at(std::int64_t i) const {
  TG_CHECK(i >= 0 && i < size_, "TokenStream::at: index ", i, " outside the stream's ", size_, " tokens");
  switch (kind_) {
    case Kind::int32: return static_cast<const std::int32_t*>(data_)[i];
    case Kind::uint16: return static_cast<std::int32_t>(static_cast<const std::uint16_t*>(data_)[i]);
    case Kind::uint32: return static_cast<std::int32_t>(static_cast<const std::uint32_t*>(data_)[i]);
  }
  return 0;
}

namespace {
template <class S>
void widen(const S* __restrict src, std::int64_t n, std::int64_t* __restrict out) {
  for (std::int64_t k = 0; k < n; ++k) out[k] = static_cast<std::int64_t>(src[k]);
}
}  // namespace

void TokenStream::copy_window(std::int64_t start, std::int64_t n, std::int64_t* out) const {
  TG_CHECK(start >= 0 && n >= 0 && start <= size_ - n, "TokenStream::copy_window: [", start, ", ", start + n,
           ") is outside the stream's ", size_, " tokens");
  switch (kind_) {
    case Kind::int32: widen(static_cast<const std::int32_t*>(data_) + start, n, out); break;
    case Kind::uint16: widen(static_cast<const std::uint16_t*>(data_) + start, n, out); break;
    case Kind::uint32: widen(static_cast<const std::uint32_t*>(data_) + start, n, out); break;
  }
}

std::span<const std::int32_t> TokenStream::int32_tokens() const {
  TG_CHECK(kind_ == Kind::int32, "TokenStream: the ids of a token file's stream (", width(),
           "-byte ids, mmapped) are not an int32 array; read them with at() or copy_window()");
  return {owned_.data(), owned_.size()};
}

const std::vector<std::int32_t>& TokenStream::vector() const {
  TG_CHECK(kind_ == Kind::int32, "TokenStream: the ids of a token file's stream (", width(),
           "-byte ids, mmapped) are not an in-memory vector; read them with at() or copy_window()");
  return owned_;
}

// ---- TextDataset ------------------------------------------------------------------------------------

TextDataset::TextDataset(std::vector<std::int32_t> tokens, double val_fraction, std::int64_t context, std::string source)
    : TextDataset(std::make_shared<const TokenStream>(std::move(tokens)), val_fraction, context, std::move(source)) {}

TextDataset::TextDataset(std::shared_ptr<const TokenStream> stream, double val_fraction, std::int64_t context,
                         std::string source)
    : tokens_(std::move(stream)), val_fraction_(val_fraction), source_(std::move(source)) {
  TG_CHECK(tokens_ && tokens_->size() > 0, "TextDataset: ", source_, " has no tokens");
  TG_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "TextDataset: ", source_, ": val_fraction must be in [0, 1), got ",
           val_fraction);
  TG_CHECK(context >= 0, "TextDataset: ", source_, ": context must be >= 0, got ", context);
  const std::int64_t n = tokens_->size();
  const auto n_val = static_cast<std::int64_t>(std::floor(static_cast<double>(n) * val_fraction));
  train_size_ = n - n_val;
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

// ---- PrefetchingSampler (Note [prefetching batches] in data/prefetch.hpp) -------------------------------

struct PrefetchingSampler::State {
  struct Slot {
    std::uint64_t counter = 0;
    Batch batch;
    std::exception_ptr error;
  };

  Producer produce;
  int depth = 2;
  mutable std::mutex mu;
  std::condition_variable work_cv;   // the worker waits for room in the queue, a new position or stop
  std::condition_variable ready_cv;  // the consumer waits for the front batch
  std::deque<Slot> ready;            // counters consumer, consumer + 1, ... in order
  std::uint64_t seed = 0;
  std::uint64_t consumer = 0;        // batches handed out
  std::uint64_t producer = 0;        // the next counter the worker prepares
  std::uint64_t generation = 0;      // bumped by set_position; a slot of an older one is discarded
  bool stop = false;
  std::thread worker;

  void run() {
    std::unique_lock lock(mu);
    for (;;) {
      work_cv.wait(lock, [&] { return stop || ready.size() < static_cast<std::size_t>(depth); });
      if (stop) return;
      const SamplerPosition p{seed, producer++};
      const std::uint64_t gen = generation;
      lock.unlock();
      Slot slot{p.counter, {}, nullptr};
      try {
        slot.batch = produce(p);
      } catch (...) {
        slot.error = std::current_exception();
      }
      lock.lock();
      if (gen != generation) continue;  // set_position meanwhile: the slot dies here (allocator is thread-safe)
      ready.push_back(std::move(slot));
      ready_cv.notify_all();
    }
  }
};

namespace {
PrefetchingSampler::Producer sampler_producer(const std::shared_ptr<const BatchSampler>& s) {
  return [s](const SamplerPosition& p) { return s->batch_at(p); };
}
}  // namespace

PrefetchingSampler::PrefetchingSampler(BatchSampler sampler, int depth)
    : PrefetchingSampler(std::make_shared<const BatchSampler>(std::move(sampler)), depth) {}

PrefetchingSampler::PrefetchingSampler(std::shared_ptr<const BatchSampler> sampler, int depth)
    : PrefetchingSampler(sampler_producer(sampler), sampler->position(), depth) {
  sampler_ = std::move(sampler);
}

PrefetchingSampler::PrefetchingSampler(Producer produce, SamplerPosition start, int depth)
    : state_(std::make_unique<State>()) {
  TG_CHECK(produce, "PrefetchingSampler: the producer is empty");
  TG_CHECK(depth >= 0, "PrefetchingSampler: depth must be >= 0 (0: no worker thread), got ", depth);
  state_->produce = std::move(produce);
  state_->depth = depth;
  state_->seed = start.seed;
  state_->consumer = state_->producer = start.counter;
  if (depth > 0) state_->worker = std::thread([st = state_.get()] { st->run(); });
}

PrefetchingSampler::~PrefetchingSampler() {
  if (!state_ || !state_->worker.joinable()) return;
  {
    std::lock_guard lock(state_->mu);
    state_->stop = true;
  }
  state_->work_cv.notify_all();
  state_->worker.join();
}

PrefetchingSampler::PrefetchingSampler(PrefetchingSampler&&) noexcept = default;

PrefetchingSampler& PrefetchingSampler::operator=(PrefetchingSampler&& other) noexcept {
  if (this != &other) {
    PrefetchingSampler old(std::move(*this));  // stops and joins this one's worker on scope exit
    sampler_ = std::move(other.sampler_);
    state_ = std::move(other.state_);
  }
  return *this;
}

Batch PrefetchingSampler::next() {
  TG_CHECK(state_, "PrefetchingSampler::next: the sampler was moved from");
  State& st = *state_;
  if (st.depth == 0) {
    SamplerPosition p;
    {
      std::lock_guard lock(st.mu);
      p = {st.seed, st.consumer++};
    }
    return st.produce(p);
  }
  State::Slot slot;
  {
    std::unique_lock lock(st.mu);
    st.ready_cv.wait(lock, [&] { return !st.ready.empty(); });
    slot = std::move(st.ready.front());
    st.ready.pop_front();
    TG_CHECK(slot.counter == st.consumer, "PrefetchingSampler: internal error: batch ", slot.counter,
             " handed out at position ", st.consumer);
    ++st.consumer;
  }
  st.work_cv.notify_all();
  if (slot.error) std::rethrow_exception(slot.error);
  return std::move(slot.batch);
}

SamplerPosition PrefetchingSampler::position() const {
  TG_CHECK(state_, "PrefetchingSampler::position: the sampler was moved from");
  std::lock_guard lock(state_->mu);
  return {state_->seed, state_->consumer};
}

void PrefetchingSampler::set_position(const SamplerPosition& p) {
  TG_CHECK(state_, "PrefetchingSampler::set_position: the sampler was moved from");
  std::deque<State::Slot> dropped;  // freed outside the lock
  {
    std::lock_guard lock(state_->mu);
    state_->seed = p.seed;
    state_->consumer = state_->producer = p.counter;
    ++state_->generation;
    dropped.swap(state_->ready);
  }
  state_->work_cv.notify_all();
}

void PrefetchingSampler::reset() { set_position({position().seed, 0}); }

int PrefetchingSampler::depth() const {
  TG_CHECK(state_, "PrefetchingSampler::depth: the sampler was moved from");
  return state_->depth;
}

}  // namespace tg::data
