// tg::dist under MPI (label `dist`; CTest runs it with mpirun -np 2 and -np 3, and alone as world size 1):
// the communicator's collectives, and data-parallel training (DDP, ZeRO-1, ZeRO-2) against one process
// training on the global batch (Note [data parallelism]).
//   mpirun -np 2 --oversubscribe build/release/tests/test_dist
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <span>
#include <utility>
#include <string>
#include <thread>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/detail/cuda/runtime.hpp>
#include <typegrad/dist/comm.hpp>
#include <typegrad/dist/data_parallel.hpp>
#include <typegrad/dist/nccl.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>

namespace test_dist_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::dist::Buffer;
using tg::dist::ReduceOp;
using F = tg::Tensor<float>;

tg::dist::Communicator& W() { return tg::dist::world(); }
int rank() { return W().rank(); }
int size() { return W().size(); }

// ---- the communicator ---------------------------------------------------------------------------------

TEST(Comm, AllReduceSumsAndAveragesEveryType) {
  const std::int64_t n = 1001;  // not a multiple of the world size: uneven chunks
  std::vector<float> f(n);
  std::vector<double> d(n);
  std::vector<std::int64_t> i64(n);
  std::vector<tg::bf16> h(n);
  for (std::int64_t i = 0; i < n; ++i) {
    f[i] = static_cast<float>(rank() + 1) + 0.5f * static_cast<float>(i % 7);
    d[i] = f[i];
    i64[i] = (rank() + 1) * 1000 + i;
    h[i] = tg::bf16(static_cast<float>(rank() + 1));
  }
  W().all_reduce(Buffer{f.data(), n, tg::DType::f32}, ReduceOp::sum);
  W().all_reduce(Buffer{d.data(), n, tg::DType::f64}, ReduceOp::avg);
  W().all_reduce(Buffer{i64.data(), n, tg::DType::i64}, ReduceOp::sum);
  W().all_reduce(Buffer{h.data(), n, tg::DType::bf16}, ReduceOp::sum);
  const double ranks_sum = size() * (size() + 1) / 2.0;
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(f[i], static_cast<float>(ranks_sum + size() * 0.5 * (i % 7))) << i;
    ASSERT_DOUBLE_EQ(d[i], ranks_sum / size() + 0.5 * (i % 7)) << i;
    ASSERT_EQ(i64[i], static_cast<std::int64_t>(ranks_sum) * 1000 + size() * i) << i;
    ASSERT_EQ(static_cast<float>(h[i]), static_cast<float>(ranks_sum)) << i;
  }
}

TEST(Comm, AllReduceLeavesTheSameBitsOnEveryRank) {
  tg::Generator g(17 + static_cast<std::uint64_t>(rank()));
  const F x = F::normal({4099}, 0.f, 1.f, g);
  W().all_reduce(x, ReduceOp::avg);
  std::string bytes(reinterpret_cast<const char*>(x.data()), x.nbytes());
  const auto all = W().all_gather_strings(bytes);
  for (int r = 0; r < size(); ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], bytes) << "rank " << r << " holds other bits";
}

TEST(Comm, ReduceScatterWithUnevenAndEmptyParts) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(size()));
  for (int r = 0; r < size(); ++r) counts[static_cast<std::size_t>(r)] = r == 1 ? 0 : r + 3;
  std::int64_t total = 0, before = 0;
  for (int r = 0; r < size(); ++r) {
    if (r < rank()) before += counts[static_cast<std::size_t>(r)];
    total += counts[static_cast<std::size_t>(r)];
  }
  std::vector<float> send(static_cast<std::size_t>(total));
  for (std::int64_t i = 0; i < total; ++i) send[static_cast<std::size_t>(i)] = static_cast<float>(i * (rank() + 1));
  std::vector<float> recv(static_cast<std::size_t>(counts[static_cast<std::size_t>(rank())]) + 1, -1.f);
  W().reduce_scatter(Buffer{send.data(), total}, Buffer{recv.data(), counts[static_cast<std::size_t>(rank())]}, counts, ReduceOp::sum);
  const double ranks_sum = size() * (size() + 1) / 2.0;
  for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(rank())]; ++i)
    EXPECT_EQ(recv[static_cast<std::size_t>(i)], static_cast<float>((before + i) * ranks_sum)) << i;
  EXPECT_EQ(recv.back(), -1.f) << "reduce_scatter wrote past this rank's part";
}

TEST(Comm, AllGatherCopiesAndInPlace) {
  std::vector<std::int64_t> counts(static_cast<std::size_t>(size()));
  std::int64_t total = 0, before = 0;
  for (int r = 0; r < size(); ++r) {
    counts[static_cast<std::size_t>(r)] = 2 * r + 1;
    if (r < rank()) before += counts[static_cast<std::size_t>(r)];
    total += counts[static_cast<std::size_t>(r)];
  }
  const std::int64_t mine = counts[static_cast<std::size_t>(rank())];
  std::vector<double> send(static_cast<std::size_t>(mine), 10.0 * rank()), recv(static_cast<std::size_t>(total), -1);
  W().all_gather(Buffer{send.data(), mine, tg::DType::f64}, Buffer{recv.data(), total, tg::DType::f64}, counts);
  std::vector<double> in_place(static_cast<std::size_t>(total), -1);
  for (std::int64_t i = 0; i < mine; ++i) in_place[static_cast<std::size_t>(before + i)] = 10.0 * rank();
  W().all_gather(Buffer{in_place.data() + before, mine, tg::DType::f64}, Buffer{in_place.data(), total, tg::DType::f64}, counts);
  std::int64_t at = 0;
  for (int r = 0; r < size(); ++r)
    for (std::int64_t i = 0; i < counts[static_cast<std::size_t>(r)]; ++i, ++at) {
      EXPECT_EQ(recv[static_cast<std::size_t>(at)], 10.0 * r);
      EXPECT_EQ(in_place[static_cast<std::size_t>(at)], 10.0 * r);
    }
}

TEST(Comm, BroadcastFromTheLastRank) {
  const int root = size() - 1;
  F x = F::full({33}, rank() == root ? 7.0 : 0.0);
  W().broadcast(x, root);
  for (float v : x.to_vector()) EXPECT_EQ(v, 7.f);
}

TEST(Comm, SendAndReceiveAroundARing) {
  if (size() == 1) GTEST_SKIP() << "one rank: no peer";
  const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
  std::int64_t out = 100 + rank(), in = -1;
  if (rank() % 2 == 0) {
    W().send(Buffer{&out, 1, tg::DType::i64}, next, 3);
    W().recv(Buffer{&in, 1, tg::DType::i64}, prev, 3);
  } else {
    W().recv(Buffer{&in, 1, tg::DType::i64}, prev, 3);
    W().send(Buffer{&out, 1, tg::DType::i64}, next, 3);
  }
  EXPECT_EQ(in, 100 + prev);
  W().barrier();
}

TEST(Comm, AsyncWorkCompletesAndReportsIt) {
  F a = F::full({100000}, 1.0), b = F::full({777}, 2.0);
  auto wa = W().all_reduce_async(tg::dist::buffer_of(a), ReduceOp::sum);
  auto wb = W().all_reduce_async(tg::dist::buffer_of(b), ReduceOp::avg);
  while (!wa.test() || !wb.test()) {
  }
  wa.wait();
  wb.wait();
  EXPECT_FALSE(wa.pending());
  EXPECT_EQ(a.at({99999}), static_cast<float>(size()));
  EXPECT_EQ(b.at({0}), 2.f);
}

TEST(Comm, BadArgumentsAreClearErrors) {
  std::vector<float> x(4);
  std::vector<std::int64_t> wrong(static_cast<std::size_t>(size()) + 1, 1);
  try {
    W().reduce_scatter(Buffer{x.data(), 4}, Buffer{x.data(), 1}, wrong, ReduceOp::sum);
    ADD_FAILURE() << "no error for a count per rank too many";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("counts given for"), std::string::npos) << e.what();
  }
  if (W().backend() == "mpi") {
    try {
      W().all_reduce(Buffer{x.data(), 4, tg::DType::f32, tg::DeviceKind::cuda}, ReduceOp::sum);
      ADD_FAILURE() << "no error for a CUDA buffer on MPI";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("NCCL"), std::string::npos) << e.what();
    }
  }
}

// A pipeline stage's exchange (Communicator::exchange_async): every rank sends to the next around the ring and
// receives from the previous one at once, then the mirror exchange (send to the previous, receive from the next),
// so every rank's neighbours post their sends before their receives, as two pipeline neighbours do.
TEST(Comm, ExchangesWithBothNeighboursAtOnce) {
  if (size() < 2) GTEST_SKIP() << "an exchange needs another rank (world size 1)";
  const int next = (rank() + 1) % size(), prev = (rank() + size() - 1) % size();
  std::vector<float> mine(3001), from_prev(3001, -1.f), from_next(3001, -1.f);
  for (std::size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<float>(rank() * 10000 + static_cast<int>(i));
  auto ex = W().exchange_async(Buffer{mine.data(), 3001}, next, 0, Buffer{from_prev.data(), 3001}, prev, 0);
  ex.sent.wait();
  ex.received.wait();
  auto back = W().exchange_async(Buffer{mine.data(), 3001}, prev, 1, Buffer{from_next.data(), 3001}, next, 1);
  back.received.wait();
  back.sent.wait();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    ASSERT_EQ(from_prev[i], static_cast<float>(prev * 10000 + static_cast<int>(i))) << i;
    ASSERT_EQ(from_next[i], static_cast<float>(next * 10000 + static_cast<int>(i))) << i;
  }
}

// Note [NCCL start-up]: without a GPU, every rank's NCCL set-up fails before the collective init, and every rank
// stops with one message naming each rank's cause (none waits in the unique id's broadcast or in the init).
TEST(Comm, NcclSetUpWithoutAGpuStopsEveryRankNamingEachCause) {
  if (tg::backend::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present (gpu-check's CudaNccl.* set the communicator up)";
  try {
    auto nccl = tg::dist::make_nccl_communicator(W());
    ADD_FAILURE() << "an NCCL communicator without a GPU";
  } catch (const tg::Error& e) {
    const std::string m = e.what();
    if (m.find("built without") != std::string::npos) GTEST_SKIP() << m;
    EXPECT_NE(m.find("was not set up, because ranks failed before it"), std::string::npos) << m;
    for (int r = 0; r < size(); ++r)
      EXPECT_NE(m.find("rank " + std::to_string(r) + ": the NCCL communicator needs a GPU"), std::string::npos) << r << ": " << m;
  }
  W().barrier();  // every rank is still in step with the others
}

TEST(Comm, WorldSizeOneNeedsNoLauncher) {
  if (tg::dist::launched_by_mpi()) {
    EXPECT_EQ(W().backend(), "mpi");
    EXPECT_GE(size(), 1);
  } else {
    EXPECT_EQ(W().backend(), "single");
    EXPECT_EQ(size(), 1);
  }
  const auto names = W().all_gather_strings("rank" + std::to_string(rank()));
  ASSERT_EQ(static_cast<int>(names.size()), size());
  for (int r = 0; r < size(); ++r) EXPECT_EQ(names[static_cast<std::size_t>(r)], "rank" + std::to_string(r));
}

// ---- data-parallel training ---------------------------------------------------------------------------

tg::nn::GPTConfig tiny_config() {
  tg::nn::GPTConfig c;
  c.vocab_size = 48;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.dropout = 0.f;  // dropout masks depend on the batch's shape: equal runs need none
  return c;
}

constexpr std::int64_t kRows = 2, kT = 12;  // rows per rank per micro-batch

struct Batch {
  tg::Tensor<std::int64_t> inputs, targets;
};
/// Rows [first, first + rows) of global micro-batch k (size()·kRows rows).
Batch rows_of(std::int64_t k, std::int64_t first, std::int64_t rows, std::int64_t V) {
  const std::int64_t global = size() * kRows;
  const auto x = tg::testing::random_tokens(global, kT, V, 1000 + static_cast<std::uint64_t>(k));
  const auto y = tg::testing::random_tokens(global, kT, V, 5000 + static_cast<std::uint64_t>(k));
  Batch b{tg::Tensor<std::int64_t>::empty({rows, kT}), tg::Tensor<std::int64_t>::empty({rows, kT})};
  std::memcpy(b.inputs.data(), x.data() + first * kT, static_cast<std::size_t>(rows * kT) * sizeof(std::int64_t));
  std::memcpy(b.targets.data(), y.data() + first * kT, static_cast<std::size_t>(rows * kT) * sizeof(std::int64_t));
  return b;
}

// Note [device-ordered waits]: W() with async Works that can be ordered "on the device". On the CPU the
// device's stream is the host, so ordering completes the operation; its host wait() stays pending, as under
// NCCL, and is counted: DataParallel must defer it to the boundary's read and then wait for every one.
struct OrderedCounts {
  std::int64_t ordered = 0;      // Works ordered on the device
  std::int64_t waited = 0;       // of those, waited for on the host afterwards
};
class OrderedWork final : public tg::dist::Work::Impl {
 public:
  OrderedWork(tg::dist::Work inner, OrderedCounts& counts) : inner_(std::move(inner)), counts_(&counts) {}
  bool test() override { return inner_.test(); }
  void wait() override {
    if (ordered_ && !waited_) ++counts_->waited;
    waited_ = true;
    inner_.wait();
  }
  bool order_on_device() override {
    inner_.wait();  // the CPU's stream is the host: the later work runs after the operation
    if (!ordered_) ++counts_->ordered;
    ordered_ = true;
    return true;
  }

 private:
  tg::dist::Work inner_;
  OrderedCounts* counts_;
  bool ordered_ = false, waited_ = false;
};
class OrderedComm final : public tg::dist::Communicator {
 public:
  explicit OrderedComm(tg::dist::Communicator& inner) : inner_(inner) {}
  OrderedCounts counts;
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return inner_.backend(); }
  tg::DeviceKind device() const override { return inner_.device(); }
  tg::dist::Work all_reduce_async(tg::dist::Buffer buf, tg::dist::ReduceOp op) override { return wrap(inner_.all_reduce_async(buf, op)); }
  tg::dist::Work reduce_scatter_async(tg::dist::Buffer send, tg::dist::Buffer recv, std::span<const std::int64_t> counts_,
                                      tg::dist::ReduceOp op) override {
    return wrap(inner_.reduce_scatter_async(send, recv, counts_, op));
  }
  tg::dist::Work all_gather_async(tg::dist::Buffer send, tg::dist::Buffer recv, std::span<const std::int64_t> counts_) override {
    return wrap(inner_.all_gather_async(send, recv, counts_));
  }
  tg::dist::Work broadcast_async(tg::dist::Buffer buf, int root) override { return wrap(inner_.broadcast_async(buf, root)); }
  void send(tg::dist::Buffer buf, int peer, int tag) override { inner_.send(buf, peer, tag); }
  void recv(tg::dist::Buffer buf, int peer, int tag) override { inner_.recv(buf, peer, tag); }
  tg::dist::Work send_async(tg::dist::Buffer buf, int peer, int tag) override { return wrap(inner_.send_async(buf, peer, tag)); }
  tg::dist::Work recv_async(tg::dist::Buffer buf, int peer, int tag) override { return wrap(inner_.recv_async(buf, peer, tag)); }
  void barrier() override { inner_.barrier(); }

 private:
  tg::dist::Work wrap(tg::dist::Work w) { return tg::dist::Work(std::make_unique<OrderedWork>(std::move(w), counts)); }
  tg::dist::Communicator& inner_;
};

struct Setup {
  std::int64_t accum = 1;
  int steps = 20;
  std::optional<tg::dist::Sharding> sharding;  // nullopt: one process on the global batch
  bool reduce_bf16 = false;
  int inject_inf_step = -1;  // this step's loss is multiplied by inf (on the last rank only when distributed)
  double clip = 1.0;
  bool device_boundary = false;  // Note [the device boundary across ranks]
  tg::optim::OnNonFinite on_non_finite = tg::optim::OnNonFinite::apply;
  bool ordered_comm = false;     // the sync's communicator is an OrderedComm over W()
};

struct Result {
  std::vector<double> losses;
  std::vector<bool> skipped;
  std::vector<std::vector<float>> weights;
  std::vector<std::string> names;
  std::vector<tg::optim::NamedTensor> state;  // the optimizer's (consolidated on rank 0 when distributed)
  std::vector<std::string> owned_state;       // parameters with optimizer state on this rank
  std::vector<double> norms;                  // each step's global gradient norm
  std::int64_t decided_on_device = 0;         // steps whose boundary the device decided
  OrderedCounts ordered;                      // Setup::ordered_comm: its Works
  std::vector<std::int64_t> pending_after_step;  // Setup::ordered_comm: the sync's deferred waits after each step
  std::int64_t buckets = 0;                   // the sync's gradient buckets
};

template <class Policy>
Result train(const Setup& s) {
  const auto cfg = tiny_config();
  tg::Generator init(7), drop(11);
  tg::nn::GPT model(cfg, init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 18, 3e-4f});
  OrderedComm ordered(W());
  std::optional<tg::dist::DataParallel<tg::cpu>> dp;
  tg::train::StepOptions options{.clip = s.clip, .on_non_finite = s.on_non_finite, .device_boundary = s.device_boundary};
  if (s.sharding) {
    dp.emplace(s.ordered_comm ? static_cast<tg::dist::Communicator&>(ordered) : W(), ps, tg::dist::DataParallelOptions{.sharding = *s.sharding, .bucket_bytes = 8 << 10, .reduce_bf16 = s.reduce_bf16});
    options.sync = &*dp;
  }
  tg::train::TrainStep<Policy> step(ps, opt, sched, options, tg::optim::GradAccumRuntime(s.accum));
  const std::int64_t first = s.sharding ? rank() * kRows : 0, rows = s.sharding ? kRows : size() * kRows;
  const bool injecting_rank = !s.sharding || rank() == size() - 1;
  Result out;
  std::int64_t k = 0;
  for (int i = 0; i < s.steps; ++i) {
    auto loss_fn = [&](const auto& logits, const Batch& b) {
      auto l = step.precision().loss(logits, b.targets);
      if (i == s.inject_inf_step && injecting_rank) l = tg::mul(l, std::numeric_limits<double>::infinity());
      return l;
    };
    const auto r = step.run(model, [&] { return rows_of(k++, first, rows, cfg.vocab_size); }, drop, loss_fn);
    out.losses.push_back(r.loss);
    out.skipped.push_back(r.skipped);
    out.norms.push_back(r.grad_norm);
    if (dp) out.pending_after_step.push_back(static_cast<std::int64_t>(dp->deferred_waits()));
  }
  out.decided_on_device = step.steps_decided_on_device();
  out.ordered = ordered.counts;
  if (dp) out.buckets = static_cast<std::int64_t>(dp->num_buckets());
  for (const auto& p : ps) {
    out.weights.push_back(p.tensor.to_vector());
    out.names.push_back(p.name);
  }
  out.state = dp ? dp->gather_optimizer_state(opt) : opt.state_tensors();
  for (const auto& p : ps)
    if (opt.param_step_count(p.name) > 0) out.owned_state.push_back(p.name);
  if (dp) {
    for (const auto& p : ps) EXPECT_EQ(opt.param_step_count(p.name) > 0, dp->owns(p.name)) << p.name << " on rank " << rank();
  }
  return out;
}

double relative(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// The values a comparison reads. The key third of each c_attn.bias is left out: its gradient is zero in exact
/// arithmetic (q·(k + b) adds the same q·b to every key's score, and softmax ignores that), so it holds only
/// rounding noise, which Adam's normalisation turns into ±lr steps whatever the reduction order.
std::vector<float> compared(const std::vector<float>& w, const std::string& name) {
  if (!name.ends_with("c_attn.bias")) return w;
  const std::size_t c = w.size() / 3;
  std::vector<float> out(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(c));
  out.insert(out.end(), w.begin() + static_cast<std::ptrdiff_t>(2 * c), w.end());
  return out;
}

/// The losses of `got` against `ref` within `tol` (relative, each step), and its weights: the whole weight
/// vector within `tol` (‖a − b‖ / ‖b‖ over every compared value) and each tensor within 10·tol.
void expect_close(const Result& got, const Result& ref, double tol, const char* what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  double worst_loss = 0, worst_tensor = 0, num = 0, den = 0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(got.skipped[i], ref.skipped[i]) << what << ": step " << i;
    if (!std::isfinite(ref.losses[i])) {
      EXPECT_FALSE(std::isfinite(got.losses[i])) << what << ": step " << i;
      continue;
    }
    const double rel = std::abs(got.losses[i] - ref.losses[i]) / std::abs(ref.losses[i]);
    worst_loss = std::max(worst_loss, rel);
    EXPECT_LE(rel, tol) << what << ": loss of step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
  }
  for (std::size_t t = 0; t < ref.weights.size(); ++t) {
    const auto a = compared(got.weights[t], ref.names[t]), b = compared(ref.weights[t], ref.names[t]);
    const double rel = relative(a, b);
    worst_tensor = std::max(worst_tensor, rel);
    EXPECT_LE(rel, 10 * tol) << what << ": " << ref.names[t];
    for (std::size_t i = 0; i < a.size(); ++i) {
      num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      den += static_cast<double>(b[i]) * b[i];
    }
  }
  const double all = std::sqrt(num / den);
  EXPECT_LE(all, tol) << what << ": the weights";
  if (rank() == 0)
    std::printf("[ dist ] %s, %d ranks, vs one process: loss %.2g, weights %.2g (worst tensor %.2g); tolerance %.0e\n", what, size(),
                worst_loss, all, worst_tensor, tol);
}

using tg::dist::Sharding;

// A step whose last backward throws after its buckets' reductions started (every rank alike) is dropped whole:
// the next steps equal those of a run that never had it, bit for bit, under DDP, ZeRO-1 and ZeRO-2 and on either
// boundary. Before StepSync::abandon_step, the next step zeroed (DDP) or dropped (ZeRO-2) the buffers of reductions
// still in flight, which then wrote the failed step's partial sums into the new step's gradients.
TEST(DataParallel, AStepThatThrowsInItsBackwardIsDroppedOnEveryRank) {
  for (const auto sharding : {Sharding::none, Sharding::optimizer, Sharding::gradients})
    for (const bool device : {false, true}) {
      auto run = [&](bool fail) {
        const auto cfg = tiny_config();
        tg::Generator init(7), drop(11);
        tg::nn::GPT model(cfg, init);
        const auto ps = model.named_parameters();
        tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
        tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 18, 3e-4f});
        tg::dist::DataParallel<tg::cpu> dp(W(), ps, {.sharding = sharding, .bucket_bytes = 8 << 10});
        tg::train::TrainStep<tg::amp::fp32_policy> step(ps, opt, sched, {.clip = 1.0, .sync = &dp, .device_boundary = device},
                                                         tg::optim::GradAccumRuntime(2));
        const std::int64_t first = rank() * kRows;
        std::int64_t k = 0;
        // One step first: DataParallel counts each parameter's gradients on its first step and starts reductions
        // from the hooks only after it.
        step.run(model, [&] { return rows_of(k++, first, kRows, cfg.vocab_size); }, drop);
        if (fail) {
          // The embedding's second gradient (the lookup's; its first is the tied LM head's) is the backward's last:
          // every other bucket's reduction has started when the hook after DataParallel's throws.
          bool armed = false;
          int deliveries = 0;
          auto& hooks = ps.front().tensor.autograd_meta()->grad_ready_hooks;
          EXPECT_EQ(ps.front().name, "wte.weight");
          hooks.push_back([&](const tg::Tensor<float>&) {
            if (armed && ++deliveries == 2) throw tg::Error("an injected failure in the backward");
          });
          int calls = 0;
          EXPECT_THROW(step.run(model, [&] { return rows_of(k++, first, kRows, cfg.vocab_size); }, drop,
                                [&](const auto& logits, const Batch& b) {
                                  armed = ++calls == 2;  // the step's last micro-batch: the one that reduces
                                  // The last rank starts that backward late: the others' reductions are still in
                                  // flight when they throw.
                                  if (armed && rank() == size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                                  return step.precision().loss(logits, b.targets);
                                }),
                       tg::Error);
          EXPECT_EQ(deliveries, 2);
          hooks.pop_back();
          EXPECT_EQ(step.steps_taken(), 1);
        }
        k = 100;
        std::vector<double> losses;
        for (int i = 0; i < 3; ++i) losses.push_back(step.run(model, [&] { return rows_of(k++, first, kRows, cfg.vocab_size); }, drop).loss);
        std::vector<std::vector<float>> w;
        for (const auto& p : ps) w.push_back(p.tensor.to_vector());
        return std::pair{losses, w};
      };
      const std::string what = std::string(sharding == Sharding::none ? "ddp" : sharding == Sharding::optimizer ? "zero1" : "zero2") +
                               (device ? ", device boundary" : ", host boundary");
      const auto ref = run(false), got = run(true);
      EXPECT_EQ(got.first, ref.first) << what;
      EXPECT_TRUE(got.second == ref.second) << what << ": the weights differ";
    }
}

TEST(DataParallel, DdpEqualsOneProcessOnTheGlobalBatchFp32) {
  const auto ref = train<tg::amp::fp32_policy>({});
  const auto got = train<tg::amp::fp32_policy>({.sharding = Sharding::none});
  expect_close(got, ref, 1e-6, "ddp fp32");
}

TEST(DataParallel, DdpWithGradientAccumulation) {
  const auto ref = train<tg::amp::fp32_policy>({.accum = 2});
  const auto got = train<tg::amp::fp32_policy>({.accum = 2, .sharding = Sharding::none});
  expect_close(got, ref, 1e-6, "ddp fp32, grad-accum 2");
}

TEST(DataParallel, DdpBf16MixedPrecision) {
  const auto ref = train<tg::amp::bf16_mixed>({});
  const auto got = train<tg::amp::bf16_mixed>({.sharding = Sharding::none});
  expect_close(got, ref, 1e-2, "ddp bf16 mixed");
}

TEST(DataParallel, DdpReducingInBf16) {
  const auto ref = train<tg::amp::fp32_policy>({});
  const auto got = train<tg::amp::fp32_policy>({.sharding = Sharding::none, .reduce_bf16 = true});
  expect_close(got, ref, 1e-2, "ddp fp32, bf16 reduction");
}

TEST(DataParallel, Fp16InfOnOneRankSkipsTheStepOnEveryRank) {
  const auto ref = train<tg::amp::fp16_mixed>({.inject_inf_step = 5});
  const auto got = train<tg::amp::fp16_mixed>({.sharding = Sharding::none, .inject_inf_step = 5});
  ASSERT_TRUE(ref.skipped[5]);
  expect_close(got, ref, 1e-2, "ddp fp16, an inf at step 5");
  const auto zero2 = train<tg::amp::fp16_mixed>({.sharding = Sharding::gradients, .inject_inf_step = 5});
  expect_close(zero2, ref, 1e-2, "zero2 fp16, an inf at step 5");
}

TEST(DataParallel, Zero1EqualsOneProcess) {
  const auto ref = train<tg::amp::fp32_policy>({.accum = 2});
  const auto got = train<tg::amp::fp32_policy>({.accum = 2, .sharding = Sharding::optimizer});
  expect_close(got, ref, 1e-6, "zero1 fp32, grad-accum 2");
}

TEST(DataParallel, Zero2EqualsOneProcess) {
  const auto ref = train<tg::amp::fp32_policy>({});
  const auto got = train<tg::amp::fp32_policy>({.sharding = Sharding::gradients});
  expect_close(got, ref, 1e-6, "zero2 fp32");
  const auto bf = train<tg::amp::bf16_mixed>({.sharding = Sharding::gradients});
  expect_close(bf, train<tg::amp::bf16_mixed>({}), 1e-2, "zero2 bf16 mixed");
}

TEST(DataParallel, ZeroShardsTheOptimizerStateAndConsolidatesIt) {
  const auto ref = train<tg::amp::fp32_policy>({.steps = 6});
  for (const auto sharding : {Sharding::optimizer, Sharding::gradients}) {
    const auto got = train<tg::amp::fp32_policy>({.steps = 6, .sharding = sharding});
    if (size() > 1) EXPECT_LT(got.owned_state.size(), ref.owned_state.size()) << "rank " << rank() << " keeps every parameter's state";
    if (rank() != 0) {
      EXPECT_TRUE(got.state.empty());
      continue;
    }
    ASSERT_EQ(got.state.size(), ref.state.size()) << "the consolidated state lacks entries";
    std::map<std::string, const F*> by_name;
    for (const auto& e : got.state) by_name[e.name] = &e.tensor;
    for (const auto& e : ref.state) {
      ASSERT_TRUE(by_name.count(e.name)) << e.name;
      EXPECT_LE(relative(by_name[e.name]->to_vector(), e.tensor.to_vector()), 1e-5) << e.name;
    }
  }
}

TEST(DataParallel, AConsolidatedCheckpointResumesSharded) {
  // 10 steps sharded (ZeRO-2), saved by rank 0, loaded by every rank, 10 more: the 20 steps of one process.
  const auto ref = train<tg::amp::fp32_policy>({.steps = 20});
  const std::string dir = "/tmp/tg_test_dist_" + W().all_gather_strings(std::to_string(::getpid()))[0];
  const std::string path = dir + "/ckpt.safetensors";
  const auto cfg = tiny_config();
  std::vector<double> losses;
  for (int part = 0; part < 2; ++part) {
    tg::Generator init(7), drop(11);
    tg::nn::GPT model(cfg, init);
    const auto ps = model.named_parameters();
    tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
    tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 18, 3e-4f});
    tg::dist::DataParallel<tg::cpu> dp(W(), ps, {.sharding = Sharding::gradients, .bucket_bytes = 8 << 10});
    std::int64_t k = 0;
    if (part == 1) {
      const auto rec = tg::io::load_train_state(path, ps, opt);
      dp.shard_loaded_state(opt);
      sched.set_step(rec.schedule_step);
      k = rec.step;
    }
    tg::train::TrainStep<tg::amp::fp32_policy> step(ps, opt, sched, {.clip = 1.0, .sync = &dp});
    if (part == 1) step.restore_steps(k);
    for (int i = 0; i < 10; ++i)
      losses.push_back(step.run(model, [&] { return rows_of(k++, rank() * kRows, kRows, cfg.vocab_size); }, drop).loss);
    if (part == 0) {
      const auto state = dp.gather_optimizer_state(opt);
      if (rank() == 0) {
        std::filesystem::create_directories(dir);
        tg::io::TrainStateRecord rec;
        rec.step = 10;
        rec.schedule_step = sched.step();
        rec.grad_accum = tg::io::GradAccumRecord{1, 0, 10};
        tg::io::save_train_state(path, ps, tg::dist::ConsolidatedState(opt, state), rec);
      }
      W().barrier();
    }
  }
  W().barrier();
  if (rank() == 0) std::filesystem::remove_all(dir);
  for (int i = 0; i < 20; ++i) EXPECT_LE(std::abs(losses[static_cast<std::size_t>(i)] - ref.losses[static_cast<std::size_t>(i)]) / ref.losses[static_cast<std::size_t>(i)], 1e-6) << "step " << i;
}

// An offloaded optimizer (Note [optimizer offload]) keeps its state in its host optimizer: after loading a
// consolidated state, a ZeRO rank keeps the state of the parameters it owns only, as without offload. Before, the
// pruning reached the (empty) device state only: every rank kept the whole state, the parameters it does not
// update kept their loaded moments and step counts, and the next consolidated save took those stale entries.
TEST(DataParallel, AShardedResumeKeepsAnOffloadedOptimizersOwnShard) {
  const auto cfg = tiny_config();
  tg::Generator init(7), drop(11);
  tg::nn::GPT model(cfg, init);
  const auto ps = model.named_parameters();
  auto make_host = [](std::vector<tg::optim::ParamGroup> g) {
    return std::make_unique<tg::optim::AdamW>(std::move(g), tg::optim::AdamWOptions{.lr = 3e-3f, .weight_decay = 0.1f});
  };
  // Every rank trains the same 2 steps alone: the whole state, as a consolidated checkpoint holds it.
  const auto trained = tg::optim::offload<tg::cpu>(tg::optim::default_groups(ps, 0.1f), make_host);
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::train::TrainStep<tg::amp::fp32_policy> alone(ps, *trained, sched, {});
  std::int64_t k = 0;
  for (int i = 0; i < 2; ++i) alone.run(model, [&] { return rows_of(k++, 0, kRows, cfg.vocab_size); }, drop);
  const auto state = trained->state_tensors();
  for (const auto sharding : {Sharding::optimizer, Sharding::gradients}) {
    tg::dist::DataParallel<tg::cpu> dp(W(), ps, {.sharding = sharding, .bucket_bytes = 8 << 10});
    const auto resumed = tg::optim::offload<tg::cpu>(tg::optim::default_groups(ps, 0.1f), make_host);
    resumed->load_state(state);
    dp.shard_loaded_state(*resumed);
    const auto& host = static_cast<const tg::optim::OffloadedOptimizer<tg::cpu>&>(*resumed).host();
    int kept = 0;
    for (const auto& p : ps) {
      EXPECT_EQ(host.param_step_count(p.name), dp.owns(p.name) ? 2 : 0) << p.name << " on rank " << rank();
      kept += dp.owns(p.name) ? 1 : 0;
    }
    std::set<std::string> named;
    for (const auto& e : resumed->state_tensors())
      if (e.name.ends_with(".step") && e.name != "optimizer.step") named.insert(e.name.substr(0, e.name.size() - 5));
    EXPECT_EQ(named.size(), static_cast<std::size_t>(kept)) << "rank " << rank() << ": the saved state names other ranks' parameters";
    if (size() > 1) EXPECT_LT(kept, static_cast<int>(ps.size()));
  }
}

// ---- the step boundary on the device in a data-parallel run (Note [the device boundary across ranks]) -----

/// `got` and `ref` bit for bit: each step's loss, skip and norm, and every weight.
void expect_same_bits(const Result& got, const Result& ref, const char* what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&got.losses[i], &ref.losses[i], sizeof(double)), 0) << what << ": loss of step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
    EXPECT_EQ(got.skipped[i], ref.skipped[i]) << what << ": step " << i;
    EXPECT_EQ(std::memcmp(&got.norms[i], &ref.norms[i], sizeof(double)), 0) << what << ": norm of step " << i << ": " << got.norms[i] << " vs " << ref.norms[i];
  }
  ASSERT_EQ(got.weights.size(), ref.weights.size());
  for (std::size_t t = 0; t < ref.weights.size(); ++t) {
    ASSERT_EQ(got.weights[t].size(), ref.weights[t].size());
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), got.weights[t].size() * sizeof(float)), 0) << what << ": " << ref.names[t];
  }
  if (rank() == 0) std::printf("[ dist ] %s, %d ranks: the device boundary equals the host boundary bit for bit\n", what, size());
}

TEST(DataParallel, DeviceBoundaryEqualsTheHostBoundaryBitForBit) {
  // DDP, ZeRO-1 (with grad accumulation 2) and ZeRO-2, clipping at 1.0: losses, norms and weights of the host boundary.
  const std::pair<Sharding, const char*> runs[] = {{Sharding::none, "ddp fp32"}, {Sharding::optimizer, "zero1 fp32, grad-accum 2"},
                                                    {Sharding::gradients, "zero2 fp32"}};
  for (const auto& [sharding, what] : runs) {
    const std::int64_t accum = sharding == Sharding::optimizer ? 2 : 1;
    const auto host = train<tg::amp::fp32_policy>({.accum = accum, .steps = 8, .sharding = sharding, .clip = 0.5});
    const auto device = train<tg::amp::fp32_policy>({.accum = accum, .steps = 8, .sharding = sharding, .clip = 0.5, .device_boundary = true});
    EXPECT_EQ(host.decided_on_device, 0);
    EXPECT_EQ(device.decided_on_device, 8) << what;
    expect_same_bits(device, host, what);
    // The norm was measured over every rank's gradients: the one process's (to the reduction order).
    const auto one = train<tg::amp::fp32_policy>({.accum = accum, .steps = 8, .clip = 0.5});
    for (std::size_t i = 0; i < one.norms.size(); ++i) EXPECT_NEAR(device.norms[i], one.norms[i], 1e-5 * one.norms[i]) << what << ", step " << i;
  }
}

// Note [device-ordered waits]: under a device boundary the bucket reductions and the boundary's sums are ordered
// on the device while the step runs and waited for on the host at its read: every one of them, and the same
// results; the host boundary waits for each at once.
TEST(DataParallel, DeviceBoundaryDefersItsHostWaitsToTheRead) {
  if (size() < 2) GTEST_SKIP() << "one rank: nothing is reduced";
  for (const auto sharding : {Sharding::none, Sharding::gradients}) {
    const char* what = sharding == Sharding::none ? "ddp fp32, ordered waits" : "zero2 fp32, ordered waits";
    const auto host = train<tg::amp::fp32_policy>({.steps = 4, .sharding = sharding, .clip = 0.5, .ordered_comm = true});
    const auto device = train<tg::amp::fp32_policy>({.steps = 4, .sharding = sharding, .clip = 0.5, .device_boundary = true, .ordered_comm = true});
    EXPECT_EQ(host.ordered.ordered, 0) << what << ": the host boundary ordered a collective on the device";
    // per step: one reduction per bucket (several: 8 KiB buckets) and the boundary's sum (ZeRO-2: and its norm's)
    EXPECT_GT(device.buckets, 1) << what;
    EXPECT_EQ(device.ordered.ordered, 4 * (device.buckets + (sharding == Sharding::none ? 1 : 2))) << what;
    EXPECT_EQ(device.ordered.waited, device.ordered.ordered) << what << ": a deferred collective was never waited for on the host";
    for (std::size_t i = 0; i < device.pending_after_step.size(); ++i) EXPECT_EQ(device.pending_after_step[i], 0) << what << ", step " << i;
    expect_same_bits(device, host, what);
  }
}

TEST(DataParallel, DeviceBoundaryFp16InfOnOneRankSkipsTheStepOnEveryRank) {
  for (const auto sharding : {Sharding::none, Sharding::gradients}) {
    const auto host = train<tg::amp::fp16_mixed>({.steps = 8, .sharding = sharding, .inject_inf_step = 5});
    const auto device = train<tg::amp::fp16_mixed>({.steps = 8, .sharding = sharding, .inject_inf_step = 5, .device_boundary = true});
    ASSERT_TRUE(device.skipped[5]);
    EXPECT_EQ(device.decided_on_device, 8);
    expect_same_bits(device, host, sharding == Sharding::none ? "ddp fp16, an inf at step 5" : "zero2 fp16, an inf at step 5");
  }
}

TEST(DataParallel, DeviceBoundaryNonFiniteLossOnOneRank) {
  // fp32 with no scaler: a non-finite loss on the last rank only. Under OnNonFinite::skip every rank skips the
  // step; under stop every rank stops, and the others say the loss was another rank's.
  const auto host = train<tg::amp::fp32_policy>({.steps = 6, .sharding = Sharding::gradients, .inject_inf_step = 3,
                                                 .on_non_finite = tg::optim::OnNonFinite::skip});
  const auto device = train<tg::amp::fp32_policy>({.steps = 6, .sharding = Sharding::gradients, .inject_inf_step = 3,
                                                   .device_boundary = true, .on_non_finite = tg::optim::OnNonFinite::skip});
  ASSERT_TRUE(device.skipped[3]);
  expect_same_bits(device, host, "zero2 fp32, a non-finite loss at step 3, skipped");
  for (const bool on_device : {false, true}) {
    try {
      train<tg::amp::fp32_policy>({.steps = 6, .sharding = Sharding::none, .inject_inf_step = 3, .device_boundary = on_device,
                                   .on_non_finite = tg::optim::OnNonFinite::stop});
      ADD_FAILURE() << "no NonFiniteStep on rank " << rank() << (on_device ? " (device boundary)" : " (host boundary)");
    } catch (const tg::optim::NonFiniteStep& e) {
      const std::string expected = rank() == size() - 1 ? "the loss is inf" : "another rank's loss is not finite";
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << "rank " << rank() << ": " << e.what();
    }
  }
}

TEST(DataParallel, DeviceBoundaryNeedsASyncThatSumsOnTheDevice) {
  // A model-parallel group's sync decides on the host (its sum_on_device is not there): an error at construction.
  struct HostOnly final : tg::train::StepSync {
    void sum(std::span<double>) const override {}
    bool sharded_grads() const override { return false; }
    int ranks() const override { return 2; }
    void before_backward(std::int64_t, std::int64_t) override {}
    void after_backward(std::int64_t, std::int64_t) override {}
    void after_update() override {}
  } host_only;
  tg::Generator init(7);
  tg::nn::GPT model(tiny_config(), init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(ps, {.lr = 1e-3f});
  tg::optim::Schedule sched = tg::optim::Constant{1e-3f};
  try {
    tg::train::TrainStep<tg::amp::fp32_policy> step(ps, opt, sched, {.sync = &host_only, .device_boundary = true});
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("decide each step on the host"), std::string::npos) << e.what();
  }
}

TEST(DataParallel, RanksWithDifferentModelsStopNamingIt) {
  if (size() == 1) GTEST_SKIP() << "one rank: nothing to differ from";
  auto cfg = tiny_config();
  if (rank() == 1) cfg.n_embd = 48;
  tg::Generator init(7);
  tg::nn::GPT model(cfg, init);
  try {
    tg::dist::DataParallel<tg::cpu> dp(W(), model.named_parameters());
    ADD_FAILURE() << "no error for different models";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("has other parameters than rank"), std::string::npos) << e.what();
  }
}

}  // namespace

}  // namespace test_dist_cpp
