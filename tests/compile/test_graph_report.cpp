// The launch watch and the compiled step's graph report (Note [launch watch], Note [graph blockers]), and the
// Philox base in memory (Note [the Philox base in memory]): argument hashes see values (not padding, not
// addresses of by-value arguments), the watch sees TG_BACKEND's CPU launches and the helpers that report
// themselves only while installed, a compiled step whose dropout draws at absolute positions is reported with
// the changing argument named, and under a PhiloxBaseScope the same step launches the same arguments every
// call while drawing fresh masks, bit for bit those of the absolute positions.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <typegrad/compile/compile.hpp>
#include <typegrad/ops/dropout.hpp>
#include <typegrad/ops/dropout_add.hpp>
#include <typegrad/ops/unary.hpp>

namespace test_graph_report_cpp {  // the file's own names (Note [unity test sources])

namespace {

namespace be = tg::backend;

struct Padded {  // 7 bytes of padding after `flag`
  bool flag = false;
  double value = 0;
  const float* where = nullptr;
};

std::uint64_t hash_of(const auto& x) { return be::watch::hash(be::watch::kSeed, x); }

TEST(LaunchWatch, HashesValuesNotPaddingOrAddresses) {
  alignas(Padded) unsigned char a_bytes[sizeof(Padded)], b_bytes[sizeof(Padded)];
  std::memset(a_bytes, 0x00, sizeof a_bytes);
  std::memset(b_bytes, 0xa5, sizeof b_bytes);  // other padding bytes
  auto* a = new (a_bytes) Padded;
  auto* b = new (b_bytes) Padded;
  a->flag = b->flag = true;
  a->value = b->value = 0.25;
  float f = 0;
  a->where = b->where = &f;
  EXPECT_EQ(hash_of(*a), hash_of(*b)) << "the padding is never read";
  b->value = 0.5;
  EXPECT_NE(hash_of(*a), hash_of(*b)) << "a field's value";
  b->value = 0.25;
  float g = 0;
  b->where = &g;
  EXPECT_NE(hash_of(*a), hash_of(*b)) << "a pointer's address";
  EXPECT_EQ(hash_of(tg::Shape{2, 3}), hash_of(tg::Shape{2, 3}));
  EXPECT_NE(hash_of(tg::Shape{2, 3}), hash_of(tg::Shape{3, 2}));
  EXPECT_NE(hash_of(tg::Shape{2, 3}), hash_of(tg::Shape{2, 3, 1}));
  EXPECT_NE(hash_of(std::string("gelu")), hash_of(std::string("relu")));
  EXPECT_NE(hash_of(std::vector<double>{1, 2}), hash_of(std::vector<double>{1, 3})) << "a vector's contents";
  EXPECT_NE(hash_of(tg::bf16(1.f)), hash_of(tg::bf16(2.f)));
  EXPECT_NE(hash_of(0.0), hash_of(-0.0)) << "a number's bits";
  tg::pw::ChainStep s1(tg::math::Unary::exp, 0), s2(tg::math::Unary::exp, 1);
  EXPECT_NE(hash_of(s1), hash_of(s2)) << "a class's watch_fields()";
}

TEST(LaunchWatch, SeesBackendLaunchesOnlyWhileInstalled) {
  const auto x = tg::Tensor<float>::full({4, 5}, 1.5), y = tg::Tensor<float>::full({4, 5}, 2.0);
  tg::capture::LaunchLog log;
  {
    be::LaunchWatchScope scope(&log);
    (void)tg::exp(x);
    (void)tg::Tensor<float>::zeros({3});
  }
  (void)tg::exp(y);  // not watched
  const auto l = log.launches();
  ASSERT_EQ(l.size(), 2u);
  EXPECT_STREQ(l[0].kernel, "unary_forward");
  EXPECT_EQ(l[0].args.size(), 5u);
  EXPECT_FALSE(l[0].returns_value);
  EXPECT_STREQ(l[1].kernel, "fill");
}

// TG_BACKEND's CUDA branch goes through the watch too: the launch is reported before the kernel runs, so this
// shows it with or without a GPU (and in a build without the CUDA backend, whose kernels throw when called).
TEST(LaunchWatch, SeesTheCudaBranchOfTgBackend) {
  tg::capture::LaunchLog log;
  {
    be::LaunchWatchScope scope(&log);
    try {
      TG_BACKEND(tg::cuda, fill<float>(nullptr, 0, 2.5f));  // no element: a CUDA build returns at once
    } catch (const tg::Error&) {                           // no CUDA backend in this build
    }
  }
  const auto l = log.launches();
  ASSERT_EQ(l.size(), 1u);
  EXPECT_STREQ(l[0].kernel, "fill");
  ASSERT_EQ(l[0].args.size(), 3u);
  EXPECT_EQ(l[0].args[2], be::watch::hash(be::watch::kSeed, 2.5f)) << "the value's hash";
  EXPECT_FALSE(l[0].returns_value);
}

// Note [CUDA graphs of a step]: graphs are a GPU step's; asking for them on a CPU step is an error at once.
TEST(CudaGraphsOption, IsRefusedForACpuStep) {
  try {
    auto c = tg::compile([] { return 1; }, {.cuda_graphs = true});
    FAIL() << "a CPU step with cuda_graphs was accepted";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("compile<tg::cuda>"), std::string::npos) << e.what();
  }
}

// A compiled dropout: with absolute positions its offset changes every call; under a PhiloxBaseScope whose cell
// holds the base, its arguments stay the same and its masks are still fresh, bit for bit the absolute ones.
TEST(GraphReport, NamesTheDropoutOffsetAndThePhiloxBaseRemovesIt) {
  const auto x = tg::Tensor<float>::full({6, 40}, 1.0);
  for (const bool in_memory : {false, true}) {
    tg::Generator gen(11), ref(11);
    std::uint64_t cell = 0;
    std::vector<std::vector<float>> got;
    auto compiled = tg::compile(
        [&] {
          std::optional<tg::PhiloxBaseScope> scope;
          if (in_memory) {
            scope.emplace(gen, tg::DeviceKind::cpu, &cell);
            cell = scope->base();  // the step's owner writes the base before its kernels run
          }
          const auto h = tg::dropout(x, 0.5, gen);
          return tg::dropout_add(h, x, 0.25, gen).to_vector();
        },
        {.verbose = false, .watch_launches = true});
    for (int i = 0; i < 5; ++i) got.push_back(compiled());
    const auto& r = compiled.graph_report();
    ASSERT_TRUE(r.compared && r.same_sequence) << r.describe();
    if (in_memory) {
      EXPECT_TRUE(r.graph_ready()) << r.describe();
    } else {
      ASSERT_EQ(r.blockers.size(), 2u) << r.describe();
      EXPECT_EQ(r.blockers[0].kernel, "dropout_forward");
      EXPECT_EQ(r.blockers[0].changed, std::vector<int>{5}) << "the offset";
      EXPECT_EQ(r.blockers[1].kernel, "dropout_add_forward");
      EXPECT_EQ(r.blockers[1].changed, std::vector<int>{5}) << "the offset";
      EXPECT_NE(r.describe().find("dropout_forward (launch "), std::string::npos) << r.describe();
    }
    for (int i = 0; i < 5; ++i) {  // the same draws as eager calls at absolute positions
      const auto h = tg::dropout(x, 0.5, ref);
      EXPECT_EQ(got[static_cast<std::size_t>(i)], tg::dropout_add(h, x, 0.25, ref).to_vector()) << "call " << i << (in_memory ? " (base in memory)" : "");
    }
    EXPECT_NE(got[3], got[4]) << "fresh masks every call";
    EXPECT_EQ(gen.offset(), ref.offset());
  }
}

TEST(GraphReport, DropoutOnAnotherGeneratorOrDeviceKindIsNotRebased) {
  tg::Generator bound(1), other(1);
  std::uint64_t cell = 12345;  // a wrong base: whoever read it would draw elsewhere
  const auto x = tg::Tensor<float>::full({64}, 1.0);
  tg::Generator ref(1);
  const auto want = tg::dropout(x, 0.5, ref).to_vector();
  const tg::PhiloxBaseScope scope(bound, tg::DeviceKind::cuda, &cell);  // bound for CUDA dropouts only
  EXPECT_EQ(tg::dropout(x, 0.5, bound).to_vector(), want) << "a CPU dropout draws at its absolute position";
  EXPECT_EQ(tg::dropout(x, 0.5, other).to_vector(), want) << "another generator draws at its own";
  const tg::detail::DropoutDraw d = tg::detail::dropout_draw<tg::cuda>(bound, 64);
  EXPECT_EQ(d.base, &cell);
  EXPECT_EQ(d.offset + scope.base(), tg::detail::dropout_position(bound.offset() - 16)) << "relative to the scope's base";
}

}  // namespace

}  // namespace test_graph_report_cpp
