// The NCCL communicator (typegrad/dist/nccl.hpp, Note [communicators]) over the world's ranks (one alone, or
// mpirun's with one GPU each): sum and mean all-reduce of fp32 and bf16, broadcast from rank 0, all-gather
// and reduce-scatter with equal and uneven counts, and the error for a host buffer. Every test skips without
// a CUDA device.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include <typegrad/dist/comm.hpp>
#include <typegrad/dist/data_parallel.hpp>
#include <typegrad/dist/nccl.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_nccl_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::dist::buffer_of;
using tg::dist::ReduceOp;
using i64 = std::int64_t;
using DF = tg::Tensor<float, tg::cuda>;

class CudaNccl : public tg::testing::GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (IsSkipped()) return;
    // one GPU per rank on a machine with several, as train_gpt chooses (NCCL refuses two ranks on one device)
    if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK"); local && tg::backend::cuda::device_count() > 1)
      tg::backend::cuda::set_device(std::atoi(local) % tg::backend::cuda::device_count());
    comm = tg::dist::make_nccl_communicator(tg::dist::world());
    rank = comm->rank();
    size = comm->size();
  }
  std::unique_ptr<tg::dist::Communicator> comm;
  int rank = 0, size = 1;
};

/// Elements x_i = (rank + 1) + i/2 mod 7 of a CUDA fp32 tensor of n elements.
DF ramp(i64 n, int rank) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (i64 i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(rank + 1) + 0.5f * static_cast<float>(i % 7);
  return DF::from_vector({n}, v);
}

TEST_F(CudaNccl, HasTheWorldsRanks) {
  EXPECT_EQ(comm->backend(), "nccl");
  EXPECT_EQ(comm->device(), tg::DeviceKind::cuda);
  EXPECT_EQ(rank, tg::dist::world().rank());
  EXPECT_EQ(size, tg::dist::world().size());
  comm->barrier();
}

TEST_F(CudaNccl, AllReduceSumsAndAverages) {
  const i64 n = 1001;
  const auto s = ramp(n, rank), a = ramp(n, rank);
  comm->all_reduce(s, ReduceOp::sum);
  comm->all_reduce(a, ReduceOp::avg);
  const auto sv = s.to_vector(), av = a.to_vector();
  const double ranks_sum = size * (size + 1) / 2.0;  // sum of rank + 1
  for (i64 i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    ASSERT_EQ(sv[k], static_cast<float>(ranks_sum + size * 0.5 * static_cast<double>(i % 7))) << i;
    ASSERT_NEAR(av[k], ranks_sum / size + 0.5 * static_cast<double>(i % 7), 1e-5) << i;
  }
}

TEST_F(CudaNccl, AllReduceSumsBf16) {
  const auto t = tg::Tensor<tg::bf16, tg::cuda>::full({257}, rank + 1);
  comm->all_reduce(t, ReduceOp::sum);
  for (auto v : t.to_vector()) ASSERT_EQ(static_cast<float>(v), static_cast<float>(size * (size + 1) / 2));
}

TEST_F(CudaNccl, BroadcastsRankZeros) {
  const auto t = ramp(99, rank);
  comm->broadcast(t, 0);
  EXPECT_EQ(t.to_vector(), ramp(99, 0).to_vector());
}

// counts[r] elements per rank: equal (NCCL's own all-gather / reduce-scatter) and uneven (grouped
// broadcasts / reduces; the same path as equal counts at world size 1).
TEST_F(CudaNccl, AllGathersAndReduceScattersWithEqualAndUnevenCounts) {
  for (const bool uneven : {false, true}) {
    std::vector<i64> counts(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
    i64 total = 0;
    for (int r = 0; r < size; ++r) {
      counts[static_cast<std::size_t>(r)] = uneven ? 3 + r : 37;
      offsets[static_cast<std::size_t>(r)] = total;
      total += counts[static_cast<std::size_t>(r)];
    }
    const i64 mine = counts[static_cast<std::size_t>(rank)];
    // all-gather: rank r sends 100 r + j, j < counts[r]
    std::vector<float> part(static_cast<std::size_t>(mine)), gathered;
    for (i64 j = 0; j < mine; ++j) part[static_cast<std::size_t>(j)] = static_cast<float>(100 * rank + j);
    for (int r = 0; r < size; ++r)
      for (i64 j = 0; j < counts[static_cast<std::size_t>(r)]; ++j) gathered.push_back(static_cast<float>(100 * r + j));
    const auto send = DF::from_vector({mine}, part);
    const auto recv = DF::zeros({total});
    comm->all_gather(buffer_of(send), buffer_of(recv), counts);
    EXPECT_EQ(recv.to_vector(), gathered) << "uneven " << uneven;
    // reduce-scatter: every rank sends k + rank at global index k; rank r gets size (offsets[r] + j) + sum of ranks
    std::vector<float> all(static_cast<std::size_t>(total)), expected(static_cast<std::size_t>(mine));
    for (i64 k = 0; k < total; ++k) all[static_cast<std::size_t>(k)] = static_cast<float>(k + rank);
    for (i64 j = 0; j < mine; ++j)
      expected[static_cast<std::size_t>(j)] =
          static_cast<float>(size * (offsets[static_cast<std::size_t>(rank)] + j) + size * (size - 1) / 2);
    const auto rs_send = DF::from_vector({total}, all);
    const auto rs_recv = DF::zeros({mine});
    comm->reduce_scatter(buffer_of(rs_send), buffer_of(rs_recv), counts, ReduceOp::sum);
    EXPECT_EQ(rs_recv.to_vector(), expected) << "uneven " << uneven;
  }
}

// ReduceOp::avg is the sum, then one scale by 1/size (as the MPI communicator computes it), not NCCL's ncclAvg
// (each input pre-multiplied by 1/size rounded to bf16: biased for 3, 5, 6, 7 ... ranks): the bf16 result equals
// the world's MPI average of the same values bit for bit.
TEST_F(CudaNccl, AverageIsTheSumThenOneScaleAsOverMpi) {
  // small integers: every partial sum is exact in bf16 whatever order either library adds in, so only the
  // scale rounds
  std::vector<float> v(999);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(static_cast<int>((7 * i + 3 * rank) % 17) - 8);
  const auto host = tg::Tensor<float>::from_vector({999}, v).to<tg::bf16>();
  const auto dev = host.to<tg::cuda>();
  comm->all_reduce(dev, ReduceOp::avg);
  tg::dist::world().all_reduce(host, ReduceOp::avg);
  const auto a = dev.to<tg::cpu>().to_vector(), b = host.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i].bits, b[i].bits) << "element " << i;
}

// DataParallel<cuda>'s step decisions (inf flags, norms, losses: host doubles) go over MPI, not through the NCCL
// communicator, which takes CUDA buffers only (they threw there before).
TEST_F(CudaNccl, DataParallelSumsHostValuesOverMpi) {
  std::vector<tg::optim::BasicParam<tg::cuda>> params{{"w", tg::Tensor<float, tg::cuda>::ones({64})}};
  tg::dist::DataParallel<tg::cuda> dp(*comm, params);
  std::vector<double> v{1.0, 2.5};
  dp.sum(v);
  EXPECT_EQ(v[0], 1.0 * size);
  EXPECT_EQ(v[1], 2.5 * size);
}

TEST_F(CudaNccl, RejectsHostBuffers) {
  const auto host = tg::Tensor<float>::ones({8});
  try {
    comm->all_reduce(host, ReduceOp::sum);
    FAIL() << "a host buffer was accepted";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dist::all_reduce: the NCCL communicator moves CUDA buffers; host tensors go through MPI"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

}  // namespace test_cuda_nccl_cpp
