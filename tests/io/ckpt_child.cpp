// tg_ckpt_child: the process test_resume's kill tests start, SIGKILL and restart. Trains a TinyRun,
// saving a checkpoint after every step, appending "<step> <loss bits as hex>" to a loss log and finally
// writing the weights; with --resume it first continues from the directory's latest checkpoint.
//   tg_ckpt_child <dir> <steps> <fp32|bf16> <losses.txt> <final.safetensors> [--resume]
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#include "tiny_run.hpp"

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s <dir> <steps> <fp32|bf16> <losses.txt> <final.safetensors> [--resume]\n", argv[0]);
    return 2;
  }
  try {
    const std::string dir = argv[1], losses = argv[4], final_path = argv[5];
    const std::int64_t steps = std::stoll(argv[2]);
    const bool resume = argc > 6 && std::strcmp(argv[6], "--resume") == 0;
    tg::testing::TinyRun run({.precision = argv[3], .steps = steps});
    tg::io::CheckpointDir ckpts(dir, /*keep=*/3);
    if (resume) {
      const std::string path = tg::io::resolve_resume(dir);
      std::printf("resumed from %s at step %lld\n", path.c_str(), static_cast<long long>(run.resume(path)));
    }
    FILE* log = std::fopen(losses.c_str(), "a");
    if (!log) throw tg::Error("tg_ckpt_child: cannot open ", losses);
    while (run.step() < steps) {
      const double loss = run.train_step();
      std::fprintf(log, "%lld %016" PRIx64 "\n", static_cast<long long>(run.step()), tg::testing::bits_of(loss));
      std::fflush(log);
      run.save(ckpts);
    }
    std::fclose(log);
    tg::io::save_weights(final_path, run.params());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tg_ckpt_child: %s\n", e.what());
    return 1;
  }
}
