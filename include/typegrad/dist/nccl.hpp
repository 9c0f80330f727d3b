// The NCCL communicator: tg::dist's collectives over CUDA buffers of this process's current device, one rank
// per process, set up over the MPI world (Note [communicators] in typegrad/dist/comm.hpp).
//   auto nccl = tg::dist::make_nccl_communicator(tg::dist::world());   // after choosing this rank's GPU
//   nccl->all_reduce(grads_on_gpu, tg::dist::ReduceOp::avg);           // ordered after the current stream's work
#pragma once

#include <memory>

#include "typegrad/dist/comm.hpp"

namespace tg::dist {

/// A communicator over NCCL for CUDA buffers of this process's current device; the NCCL unique id is made by
/// rank 0 and broadcast over `bootstrap` (the MPI world, host buffers). Same rank/size as bootstrap. Throws
/// tg::Error naming the problem when typegrad was built without CUDA (or NCCL) or there is no GPU.
std::unique_ptr<Communicator> make_nccl_communicator(Communicator& bootstrap);

}  // namespace tg::dist
