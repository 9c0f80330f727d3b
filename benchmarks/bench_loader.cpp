// The data loader over a token file: start-up (open + validation scan), the resident memory the open adds,
// and batch throughput of the plain BatchSampler and the PrefetchingSampler, printed as a table.
//   bench_loader                                   # 500M tokens (~1 GB) in $TMPDIR, B=16, T=1024
//   bench_loader --dir /scratch --tokens 100000000 --batches 500 --work-ms 5
//
// The file is written with write_token_file (ids pseudo-random in [0, vocab)), fsynced, and deleted at the
// end. Start-up is timed twice: "cold" after posix_fadvise(POSIX_FADV_DONTNEED) asked the kernel to drop the
// file's pages from the page cache (a VM's host may still cache them), and "warm" with every page in the
// page cache (nothing dropped; the median of 3 opens). Resident memory is read from /proc/self/statm before
// the open and after it, as the whole resident set and as its anonymous part (resident - shared: memory the
// process owns, as opposed to the page cache's file pages mapped into it). Throughput is tokens per second of
// batches (B * T per batch) handed to a consumer that does nothing else, and then one that busy-works
// --work-ms per batch (a stand-in for the training step) so the prefetcher's overlap shows; the last two rows
// drop the file from the page cache first, so that every window is read from the disk.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <typegrad/data/prefetch.hpp>
#include <typegrad/data/token_file.hpp>

namespace {

namespace fs = std::filesystem;
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// (resident, shared) bytes from /proc/self/statm.
std::pair<double, double> statm() {
  std::ifstream in("/proc/self/statm");
  long size = 0, resident = 0, shared = 0;
  in >> size >> resident >> shared;
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  return {static_cast<double>(resident) * page, static_cast<double>(shared) * page};
}

void busy_work(double ms) {
  const auto until = clock_type::now() + std::chrono::duration<double, std::milli>(ms);
  while (clock_type::now() < until) {
  }
}

struct Run {
  double seconds = 0;
  std::int64_t checksum = 0;  // sum of every input id: the same batches give the same sum
};

template <class Sampler>
Run take_batches(Sampler& s, std::int64_t batches, double work_ms) {
  Run r;
  const auto t0 = clock_type::now();
  for (std::int64_t i = 0; i < batches; ++i) {
    const tg::data::Batch b = s.next();
    r.checksum += b.inputs.data()[0] + b.inputs.data()[b.inputs.numel() - 1];
    if (work_ms > 0) busy_work(work_ms);
  }
  r.seconds = seconds_since(t0);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir_flag;
  std::int64_t n_tokens = 500'000'000, vocab = 50257, B = 16, T = 1024, batches = 400;
  double work_ms = 5.0;
  int depth = 2;
  bool keep = false;
  CLI::App app{"bench_loader: token-file start-up, resident memory and loader throughput"};
  app.add_option("--dir", dir_flag, "directory for the token file (default: $TMPDIR, else /tmp)");
  app.add_option("--tokens", n_tokens, "tokens in the file (2 bytes each)")->check(CLI::PositiveNumber);
  app.add_option("--vocab", vocab, "vocabulary of the pseudo-random ids")->check(CLI::Range(2, 65536));
  app.add_option("--batch", B)->check(CLI::PositiveNumber);
  app.add_option("--seq", T)->check(CLI::PositiveNumber);
  app.add_option("--batches", batches, "batches per throughput row")->check(CLI::PositiveNumber);
  app.add_option("--work-ms", work_ms, "simulated consumer work per batch in the last two rows")->check(CLI::NonNegativeNumber);
  app.add_option("--depth", depth, "PrefetchingSampler depth")->check(CLI::PositiveNumber);
  app.add_flag("--keep", keep, "keep the token file");
  CLI11_PARSE(app, argc, argv);

  const char* tmpdir = std::getenv("TMPDIR");
  const fs::path dir = !dir_flag.empty() ? fs::path(dir_flag) : fs::path(tmpdir && *tmpdir ? tmpdir : "/tmp");
  std::error_code ec;
  const auto space = fs::space(dir, ec);
  if (ec) {
    std::fprintf(stderr, "bench_loader: cannot query free space of '%s': %s\n", dir.c_str(), ec.message().c_str());
    return 1;
  }
  const double need = std::max(3.0e9, 3.0 * 2.0 * static_cast<double>(n_tokens));
  if (static_cast<double>(space.available) < need) {
    std::fprintf(stderr,
                 "bench_loader: '%s' has %.2f GB free; this benchmark writes a %.2f GB file and wants %.1f GB free. "
                 "Pass --dir with more room, or fewer --tokens.\n",
                 dir.c_str(), static_cast<double>(space.available) / 1e9, 2.0 * static_cast<double>(n_tokens) / 1e9,
                 need / 1e9);
    return 1;
  }
  const fs::path path = dir / ("bench_loader_" + std::to_string(::getpid()) + ".bin");
  struct Cleanup {
    fs::path p;
    bool keep;
    ~Cleanup() {
      if (keep) return;
      std::error_code e;
      fs::remove(p, e);
    }
  } cleanup{path, keep};

  // ---- write ----
  auto t0 = clock_type::now();
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n_tokens));
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n_tokens; ++i) {
    std::uint64_t x = static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    tokens[static_cast<std::size_t>(i)] = static_cast<std::int32_t>((x >> 16) % static_cast<std::uint64_t>(vocab));
  }
  const double gen_s = seconds_since(t0);
  t0 = clock_type::now();
  tg::data::write_token_file(path, tokens, vocab, "");
  const double write_s = seconds_since(t0);
  const double file_gb = static_cast<double>(fs::file_size(path)) / 1e9;

  // In-memory reference: the same ids as an int32 vector.
  double mem_tps = 0;
  {
    const tg::data::TextDataset mem(std::move(tokens), 0.0);
    tg::data::BatchSampler s(mem.train(), B, T, 1);
    take_batches(s, 20, 0);
    mem_tps = static_cast<double>(batches * B * T) / take_batches(s, batches, 0).seconds;
  }
  tokens = {};

  // ---- start-up ----
  double cold_s = -1;
  {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0 && ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0) {
      ::close(fd);
      t0 = clock_type::now();
      const auto ds = tg::data::TextDataset::from_token_file(path, vocab, 0.0);
      cold_s = seconds_since(t0);
    } else if (fd >= 0) {
      ::close(fd);
    }
  }
  std::vector<double> warm;
  for (int i = 0; i < 3; ++i) {
    t0 = clock_type::now();
    const auto ds = tg::data::TextDataset::from_token_file(path, vocab, 0.0);
    warm.push_back(seconds_since(t0));
  }
  std::sort(warm.begin(), warm.end());

  const auto [res0, shr0] = statm();
  const tg::data::TextDataset ds = tg::data::TextDataset::from_token_file(path, vocab, 0.0);
  const auto [res1, shr1] = statm();
  const double rss_mib = (res1 - res0) / (1 << 20), anon_mib = ((res1 - shr1) - (res0 - shr0)) / (1 << 20);

  // ---- throughput ----
  struct Row {
    const char* name;
    double work;
    bool prefetch;
    bool cold;
    Run run;
  };
  std::vector<Row> rows = {{"BatchSampler", 0, false, false, {}},
                           {"PrefetchingSampler", 0, true, false, {}},
                           {"BatchSampler + work", work_ms, false, false, {}},
                           {"PrefetchingSampler + work", work_ms, true, false, {}},
                           {"BatchSampler + work, cold page cache", work_ms, false, true, {}},
                           {"PrefetchingSampler + work, cold page cache", work_ms, true, true, {}}};
  for (auto& row : rows) {
    if (row.cold) {
      // A fresh open (its scan leaves no page mapped), then the file's pages dropped from the page cache:
      // every window is then read from the disk, as with a corpus larger than memory.
      const auto cold_ds = tg::data::TextDataset::from_token_file(path, vocab, 0.0);
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        ::close(fd);
      }
      tg::data::BatchSampler s(cold_ds.train(), B, T, 1);
      if (row.prefetch) {
        tg::data::PrefetchingSampler p(s, depth);
        row.run = take_batches(p, batches, row.work);
      } else {
        row.run = take_batches(s, batches, row.work);
      }
      continue;
    }
    tg::data::BatchSampler s(ds.train(), B, T, 1);
    if (row.prefetch) {
      tg::data::PrefetchingSampler p(s, depth);
      take_batches(p, 20, 0);
      p.set_position(s.position());  // from batch 0 again, like the plain rows
      row.run = take_batches(p, batches, row.work);
    } else {
      take_batches(s, 20, 0);
      s.reset();
      row.run = take_batches(s, batches, row.work);
    }
  }
  const auto [res2, shr2] = statm();

  std::printf("bench_loader: %lld tokens (%.2f GB token file, vocab %lld) in %s\n", static_cast<long long>(n_tokens),
              file_gb, static_cast<long long>(vocab), dir.c_str());
  std::printf("  generate %.2f s, write_token_file %.2f s (%.2f GB/s, fsync included)\n", gen_s, write_s,
              file_gb / write_s);
  std::printf("\n| start-up: open_token_file + TextDataset (id scan included) | seconds | GB/s |\n|---|---|---|\n");
  if (cold_s >= 0)
    std::printf("| cold (after posix_fadvise DONTNEED) | %.3f | %.2f |\n", cold_s, file_gb / cold_s);
  std::printf("| warm (page cache, median of 3) | %.3f | %.2f |\n", warm[1], file_gb / warm[1]);
  std::printf("\n| resident memory added by the open | MiB |\n|---|---|\n");
  std::printf("| resident set (statm resident) | %.1f |\n| anonymous (resident - shared) | %.1f |\n", rss_mib, anon_mib);
  std::printf("| resident set after the throughput rows (%lld x 6 batches read) | %.1f |\n",
              static_cast<long long>(batches), (res2 - res0) / (1 << 20));
  std::printf("\n| loader, B=%lld T=%lld random batches (%lld per row) | ms/batch | Mtokens/s | loader ms/batch |\n"
              "|---|---|---|---|\n",
              static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(batches));
  std::printf("| BatchSampler over an in-memory int32 stream (reference) | %.3f | %.1f | |\n",
              1e3 * static_cast<double>(B * T) / mem_tps, mem_tps / 1e6);
  for (const auto& row : rows) {
    const double ms = 1e3 * row.run.seconds / static_cast<double>(batches);
    const double tps = static_cast<double>(batches * B * T) / row.run.seconds;
    std::printf("| %s%s | %.3f | %.1f | %.3f |\n", row.name,
                row.work > 0 ? (" (" + std::to_string(static_cast<int>(row.work)) + " ms busy work/batch)").c_str() : "",
                ms, tps / 1e6, ms - row.work);
  }
  bool same = true;
  for (const auto& row : rows) same = same && row.run.checksum == rows[0].run.checksum;
  std::printf("\nsame batches in every row: %s\n", same ? "yes" : "NO");
  return same ? 0 : 1;
}
