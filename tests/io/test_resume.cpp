// Exact resume: a run stopped at step k and resumed from its checkpoint matches the uninterrupted run bit
// for bit (losses, weights, optimizer state), fp32 and bf16 compute, with gradient accumulation and
// dropout; and processes SIGKILLed during training or during a save resume from the last complete checkpoint.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "tiny_run.hpp"

namespace fs = std::filesystem;
using tg::testing::bits_of;
using tg::testing::TinyRun;
using tg::testing::TinyRunConfig;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("tg_resume_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void expect_same_tensors(const std::vector<tg::optim::NamedTensor>& a, const std::vector<tg::optim::NamedTensor>& b,
                         const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].name, b[i].name) << what;
    ASSERT_TRUE(a[i].tensor.shape() == b[i].tensor.shape()) << what << " " << a[i].name;
    EXPECT_EQ(0, std::memcmp(a[i].tensor.data(), b[i].tensor.data(), a[i].tensor.nbytes()))
        << what << ": " << a[i].name << " differs";
  }
}
std::vector<tg::optim::NamedTensor> weights_of(const TinyRun& r) {
  std::vector<tg::optim::NamedTensor> out;
  for (const auto& p : r.params()) out.push_back({p.name, p.tensor});
  return out;
}

class ExactResume : public ::testing::TestWithParam<std::string> {};

TEST_P(ExactResume, interrupted_run_is_bit_identical_to_uninterrupted) {
  // Bit for bit needs one team size throughout: pin it, so that the library does not shrink the team while
  // other programs load the machine (Note [threads under contention]: fp64 reductions round per team).
  struct Pin {
    Pin() { tg::backend::cpu::set_num_threads(tg::backend::cpu::num_threads()); }
    ~Pin() { tg::backend::cpu::set_num_threads(0); }
  } pin;
  const TinyRunConfig cfg{.precision = GetParam(), .steps = 6, .grad_accum = 2, .dropout = 0.1f};
  constexpr std::int64_t k = 3;

  TinyRun full(cfg);
  std::vector<double> full_losses;
  for (int s = 0; s < cfg.steps; ++s) full_losses.push_back(full.train_step());

  const fs::path dir = fresh_dir("exact_" + cfg.precision);
  std::string ckpt;
  {
    TinyRun first(cfg);
    tg::io::CheckpointDir d(dir.string(), 2);
    for (std::int64_t s = 0; s < k; ++s) {
      const double l = first.train_step();
      EXPECT_EQ(bits_of(l), bits_of(full_losses[static_cast<std::size_t>(s)])) << "step " << s + 1 << " before the stop";
      ckpt = first.save(d);
    }
    // first is destroyed here: nothing but the file carries over.
  }
  // A different init seed: every weight must come from the checkpoint.
  TinyRun resumed(cfg, /*init_seed=*/999);
  ASSERT_EQ(resumed.resume(ckpt), k);
  EXPECT_EQ(resumed.schedule().step(), k);
  EXPECT_EQ(resumed.sampler().position().counter, static_cast<std::uint64_t>(k * cfg.grad_accum));
  for (std::int64_t s = k; s < cfg.steps; ++s) {
    const double l = resumed.train_step();
    EXPECT_EQ(bits_of(l), bits_of(full_losses[static_cast<std::size_t>(s)]))
        << cfg.precision << " step " << s + 1 << ": resumed loss " << l << ", uninterrupted " << full_losses[static_cast<std::size_t>(s)];
  }
  expect_same_tensors(weights_of(resumed), weights_of(full), cfg.precision + " weights");
  expect_same_tensors(resumed.optimizer().state_tensors(), full.optimizer().state_tensors(), cfg.precision + " optimizer state");
  EXPECT_EQ(resumed.dropout_generator().offset(), full.dropout_generator().offset());
  EXPECT_EQ(resumed.scaler_state(), full.scaler_state()) << cfg.precision << " loss-scaler state";
  if (cfg.precision == "fp16") {
    // The scaler really moved (so restoring it mattered): overflow backoffs and/or growth happened.
    const tg::amp::ScalerState st = full.scaler_state();
    EXPECT_NE(st.scale, 65536.0) << "fp16: the scale never left its initial value in this run";
    std::printf("[resume] fp16 scaler after %lld steps: scale %.0f, %lld skipped, tracker %lld\n",
                static_cast<long long>(st.steps), st.scale, static_cast<long long>(st.skipped_steps),
                static_cast<long long>(st.growth_tracker));
  }
  std::printf("[resume] %s: %lld steps, stopped after %lld, losses %.6f .. %.6f, all bit-identical\n", cfg.precision.c_str(),
              static_cast<long long>(cfg.steps), static_cast<long long>(k), full_losses.front(), full_losses.back());
  fs::remove_all(dir);
}

TEST_P(ExactResume, without_restoring_positions_the_run_differs) {
  // The control: the same checkpoint loaded into a fresh run whose sampler and dropout generator are NOT
  // restored gives different losses, so the bit-identity above is not an accident of the data.
  const TinyRunConfig cfg{.precision = GetParam(), .steps = 4};
  TinyRun full(cfg);
  std::vector<double> losses;
  for (int s = 0; s < 4; ++s) losses.push_back(full.train_step());
  const fs::path dir = fresh_dir("control_" + cfg.precision);
  TinyRun first(cfg);
  tg::io::CheckpointDir d(dir.string());
  first.train_step();
  first.train_step();
  const std::string ckpt = first.save(d);
  TinyRun other(cfg);
  tg::io::load_train_state(ckpt, other.params(), other.optimizer());  // weights and optimizer only
  other.refresh_weight_copies();
  EXPECT_NE(bits_of(other.train_step()), bits_of(losses[2]));
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Precisions, ExactResume, ::testing::Values("fp32", "bf16", "fp16"));

TEST(CheckpointDir, keeps_the_last_k_and_ignores_temporaries) {
  const fs::path dir = fresh_dir("keep");
  TinyRun run({.steps = 5, .grad_accum = 1});
  tg::io::CheckpointDir d(dir.string(), 2);
  EXPECT_FALSE(d.latest().has_value());
  EXPECT_THROW(tg::io::resolve_resume(dir.string()), tg::Error);
  for (int s = 0; s < 4; ++s) {
    run.train_step();
    run.save(d);
  }
  // A leftover temporary (a save killed half-way) and unrelated files are never taken for checkpoints.
  std::ofstream(dir / ".ckpt-00000009.safetensors.tmp-1-1") << "partial";
  std::ofstream(dir / "ckpt-notanumber.safetensors") << "x";
  const auto all = d.list();
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].first, 3);
  EXPECT_EQ(all[1].first, 4);
  EXPECT_EQ(tg::io::resolve_resume(dir.string()), d.path_for(4));
  EXPECT_EQ(tg::io::read_train_state_record(d.path_for(4)).step, 4);
  EXPECT_EQ(tg::io::resolve_resume(d.path_for(3)), d.path_for(3));
  fs::remove_all(dir);
}

// Note [runs own their checkpoints]: keep-last-K counts and deletes only the saving run's checkpoints,
// a save never replaces another run's file, and other_runs / checkpoint_run_id tell the runs apart.
TEST(CheckpointDir, keep_deletes_only_the_saving_runs_checkpoints) {
  const fs::path dir = fresh_dir("owners");
  TinyRun old_run({.steps = 8, .grad_accum = 1}), new_run({.steps = 8, .grad_accum = 1});
  tg::io::CheckpointDir d(dir.string(), 2);
  auto save_as = [&](TinyRun& run, const std::string& id) {
    tg::io::TrainStateRecord r = run.record();
    r.run_id = id;
    return d.save(run.params(), run.optimizer(), r);
  };
  for (int s = 0; s < 8; ++s) {  // the old run: steps 1..8, keeps 7 and 8
    old_run.train_step();
    if (s >= 4) save_as(old_run, "old");
  }
  for (int s = 0; s < 3; ++s) {  // the new run: steps 1..3, keeps 2 and 3; the old run's stay
    new_run.train_step();
    save_as(new_run, "new");
  }
  std::vector<std::int64_t> steps;
  for (const auto& [step, path] : d.list()) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<std::int64_t>{2, 3, 7, 8}));
  EXPECT_EQ(tg::io::checkpoint_run_id(d.path_for(8)), std::optional<std::string>("old"));
  EXPECT_EQ(tg::io::checkpoint_run_id(d.path_for(3)), std::optional<std::string>("new"));
  EXPECT_EQ(d.other_runs("new").size(), 2u);
  EXPECT_EQ(d.other_runs("old").size(), 2u);
  EXPECT_EQ(d.other_runs("other").size(), 4u);
  // Saving step 7 as the new run would replace the old run's file: refused, the file unchanged.
  const auto before = fs::file_size(d.path_for(7));
  for (int s = 0; s < 4; ++s) new_run.train_step();
  try {
    save_as(new_run, "new");
    ADD_FAILURE() << "the old run's checkpoint was replaced";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to another run (run old); not replacing it"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tg::io::checkpoint_run_id(d.path_for(7)), std::optional<std::string>("old"));
  EXPECT_EQ(fs::file_size(d.path_for(7)), before);
  // A file that is not a checkpoint has no run; one without an id (older files) has the empty one.
  std::ofstream(dir / "ckpt-00000099.safetensors") << "not a checkpoint";
  EXPECT_EQ(tg::io::checkpoint_run_id((dir / "ckpt-00000099.safetensors").string()), std::nullopt);
  tg::io::TrainStateRecord legacy = old_run.record();
  legacy.run_id.clear();
  tg::io::save_train_state((dir / "legacy.safetensors").string(), old_run.params(), old_run.optimizer(), legacy);
  EXPECT_EQ(tg::io::checkpoint_run_id((dir / "legacy.safetensors").string()), std::optional<std::string>(""));
  fs::remove_all(dir);
}

TEST(CheckpointDir, resume_choice_verifies_and_falls_back_only_when_asked) {
  const fs::path dir = fresh_dir("fallback");
  TinyRun run({.steps = 3, .grad_accum = 1});
  tg::io::CheckpointDir d(dir.string());
  for (int s = 0; s < 3; ++s) {
    run.train_step();
    run.save(d);
  }
  {  // damage the newest: one byte of its tensor data
    std::fstream f(d.path_for(3), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-3, std::ios::end);
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  try {
    tg::io::choose_resume(dir.string());
    ADD_FAILURE() << "a damaged newest checkpoint was chosen";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is damaged"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(d.path_for(3)), std::string::npos) << e.what();
  }
  const tg::io::ResumeChoice c = tg::io::choose_resume(dir.string(), /*fallback_to_intact=*/true);
  EXPECT_EQ(c.path, d.path_for(2));
  ASSERT_EQ(c.skipped.size(), 1u);
  EXPECT_EQ(c.skipped[0].first, d.path_for(3));
  ASSERT_TRUE(c.record.has_value());
  EXPECT_EQ(c.record->step, 2);
  fs::remove_all(dir);
}

TEST(CheckpointDir, stale_temporaries_of_dead_writers_go_live_ones_stay) {
  const fs::path dir = fresh_dir("temps");
  tg::io::CheckpointDir d(dir.string());
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ::waitpid(child, nullptr, 0);  // a pid whose process is gone
  const fs::path dead = dir / (".ckpt-00000004.safetensors.tmp-" + std::to_string(child) + "-1");
  const fs::path live = dir / (".ckpt-00000004.safetensors.tmp-" + std::to_string(::getppid()) + "-1");
  std::ofstream(dead) << "partial";
  std::ofstream(live) << "partial";
  EXPECT_EQ(d.remove_stale_temporaries(), 1);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  d.check_writable();
  EXPECT_THROW(tg::io::CheckpointDir(live.string()), tg::Error);  // a regular file is no save directory
  fs::remove_all(dir);
}

// ---- SIGKILL tests -----------------------------------------------------------------------------------
#ifndef TG_CKPT_CHILD
#error "TG_CKPT_CHILD (the path of tg_ckpt_child) must be defined by the build"
#endif

struct Child {
  pid_t pid = -1;
};

Child spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::execv(argv[0], argv.data());
    std::perror("execv");
    ::_exit(127);
  }
  return {pid};
}
int wait_exit(const Child& c) {
  int status = 0;
  ::waitpid(c.pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}
int run_to_end(const std::vector<std::string>& args) { return wait_exit(spawn(args, {})); }

/// Polls until pred() or 120 s pass.
template <class Pred>
bool wait_for(Pred pred) {
  const auto t0 = std::chrono::steady_clock::now();
  while (!pred()) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(120)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

std::multimap<std::int64_t, std::string> read_losses(const fs::path& p) {
  std::multimap<std::int64_t, std::string> out;
  std::ifstream in(p);
  std::int64_t step;
  std::string hex;
  while (in >> step >> hex) out.emplace(step, hex);
  return out;
}

class KillTest : public ::testing::TestWithParam<std::string> {
 public:
  static constexpr std::int64_t kSteps = 8;
  fs::path root;
  std::multimap<std::int64_t, std::string> ref_losses;
  tg::io::SafetensorsReader ref_weights_reader() const { return tg::io::SafetensorsReader::open((root / "ref.safetensors").string()); }

  void SetUp() override {
    static int n = 0;
    root = fresh_dir("kill" + std::to_string(++n));
    ASSERT_EQ(0, run_to_end({TG_CKPT_CHILD, (root / "ref").string(), std::to_string(kSteps), GetParam(), (root / "ref_losses.txt").string(),
                             (root / "ref.safetensors").string()}));
    ref_losses = read_losses(root / "ref_losses.txt");
    ASSERT_EQ(ref_losses.size(), static_cast<std::size_t>(kSteps));
  }
  void TearDown() override { fs::remove_all(root); }

  std::vector<std::string> child_args(const std::string& run, bool resume) const {
    std::vector<std::string> a{TG_CKPT_CHILD, (root / run).string(), std::to_string(kSteps), GetParam(),
                               (root / (run + "_losses.txt")).string(), (root / (run + ".safetensors")).string()};
    if (resume) a.push_back("--resume");
    return a;
  }

  /// Resumes `run` to the end and checks every loss it logged (before and after the kill) and its final
  /// weights against the uninterrupted reference, bit for bit.
  void resume_and_compare(const std::string& run) {
    ASSERT_EQ(0, run_to_end(child_args(run, true)));
    const auto losses = read_losses(root / (run + "_losses.txt"));
    for (std::int64_t s = 1; s <= kSteps; ++s) ASSERT_GE(losses.count(s), 1u) << "step " << s << " never logged";
    for (const auto& [step, hex] : losses)
      EXPECT_EQ(hex, ref_losses.find(step)->second) << run << ": the loss of step " << step << " differs from the uninterrupted run";
    const auto got = tg::io::SafetensorsReader::open((root / (run + ".safetensors")).string());
    const auto ref = ref_weights_reader();
    ASSERT_EQ(got.tensors().size(), ref.tensors().size());
    for (const auto& t : ref.tensors()) {
      const auto a = got.bytes(t.name), b = ref.bytes(t.name);
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size())) << run << ": weight " << t.name << " differs";
    }
  }
};

TEST_P(KillTest, sigkill_during_training_resumes_from_last_complete_checkpoint) {
  const fs::path dir = root / "a";
  const Child c = spawn(child_args("a", false), {});
  tg::io::CheckpointDir probe(dir.string());
  ASSERT_TRUE(wait_for([&] { return !probe.list().empty() && probe.list().back().first >= 3; })) << "no checkpoint 3";
  ASSERT_EQ(0, ::kill(c.pid, SIGKILL));
  EXPECT_EQ(wait_exit(c), -SIGKILL);
  const auto latest = probe.latest();
  ASSERT_TRUE(latest.has_value());
  const auto rec = tg::io::read_train_state_record(*latest);  // complete and intact
  EXPECT_GE(rec.step, 3);
  EXPECT_LT(rec.step, kSteps) << "the child finished before it was killed; the test proves nothing";
  std::printf("[kill] %s: SIGKILL during training; last complete checkpoint: step %lld\n", GetParam().c_str(),
              static_cast<long long>(rec.step));
  resume_and_compare("a");
}

void kill_during_save(KillTest& t, const fs::path& root, const std::string& stage, const std::string& param) {
  // Pause inside the 4th save (step 4): after half its bytes (mid-write) or once complete but not renamed.
  const fs::path marker = root / ("paused_" + stage);
  const Child c = spawn(t.child_args(stage, false), {{"TG_IO_TEST_PAUSE", stage}, {"TG_IO_TEST_PAUSE_AT", "4"},
                                                     {"TG_IO_TEST_PAUSE_MARKER", marker.string()}});
  ASSERT_TRUE(wait_for([&] { return fs::exists(marker); })) << "the child never reached the " << stage << " hook";
  ASSERT_EQ(0, ::kill(c.pid, SIGKILL));
  EXPECT_EQ(wait_exit(c), -SIGKILL);
  const fs::path dir = root / stage;
  tg::io::CheckpointDir probe(dir.string());
  // The interrupted save left its temporary behind; it is not a checkpoint.
  std::vector<fs::path> temps;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp-") != std::string::npos) temps.push_back(e.path());
  ASSERT_EQ(temps.size(), 1u) << "expected exactly the interrupted save's temporary";
  const auto latest = probe.latest();
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(*latest, probe.path_for(3)) << "the previous checkpoint must be the latest";
  EXPECT_EQ(tg::io::read_train_state_record(*latest).step, 3);
  const auto tmp_size = fs::file_size(temps[0]), full_size = fs::file_size(*latest);
  if (stage == "mid-write") {
    EXPECT_LT(tmp_size, full_size) << "the temporary should be partial";
    // A partial file is rejected by the reader (so even a careless caller could not load it).
    EXPECT_THROW(tg::io::read_train_state_record(temps[0].string()), tg::Error);
  } else {
    EXPECT_EQ(tmp_size, full_size) << "before-rename: the temporary is complete";
  }
  std::printf("[kill] %s: SIGKILL %s in the save of step 4 (temporary %ju of %ju bytes); resuming from step 3\n",
              param.c_str(), stage.c_str(), static_cast<std::uintmax_t>(tmp_size), static_cast<std::uintmax_t>(full_size));
  t.resume_and_compare(stage);
  // The resumed run's successful saves removed the stale temporary.
  for (const auto& e : fs::directory_iterator(dir))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << "stale temporary " << e.path();
}

TEST_P(KillTest, sigkill_mid_write_keeps_previous_checkpoint) { kill_during_save(*this, root, "mid-write", GetParam()); }
TEST_P(KillTest, sigkill_before_rename_keeps_previous_checkpoint) { kill_during_save(*this, root, "before-rename", GetParam()); }

INSTANTIATE_TEST_SUITE_P(Precisions, KillTest, ::testing::Values("fp32", "bf16"));

}  // namespace
