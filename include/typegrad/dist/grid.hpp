// The process grid of a run: data × pipeline × tensor parallelism over the world, and each rank's groups.
//   tg::dist::ProcessGrid grid(tg::dist::world(), /*tp=*/2, /*pp=*/2);    // 8 ranks: dp = 2
//   grid.tp->all_reduce(...);  grid.pp->send(...);  grid.dp->all_reduce(...);  grid.model->...;
#pragma once

#include <memory>

#include "typegrad/dist/comm.hpp"

namespace tg::dist {

// Note [process grid]
// world = dp × pp × tp ranks, tensor parallelism innermost (its all-reduces are the most frequent and the
// largest, so its ranks are neighbours: the same machine when a machine's GPUs are consecutive ranks), then
// pipeline, then data: world rank = (dp_rank · pp + pp_rank) · tp + tp_rank. Each rank belongs to one group of
// each kind: its tensor-parallel group (same dp, pp), its pipeline (same dp, tp), its data-parallel group
// (same pp, tp: the replicas of its part of the model) and its model group (same dp: the tp · pp ranks that
// hold one whole replica). A grid that does not divide the world is an error naming the sizes, before any
// group is made.
struct ProcessGrid {
  ProcessGrid(Communicator& w, int tp_size, int pp_size) : world(&w), tp_size(tp_size), pp_size(pp_size) {
    TG_CHECK(tp_size >= 1 && pp_size >= 1, "process grid: --tp and --pp must be at least 1, got ", tp_size, " and ", pp_size);
    TG_CHECK(w.size() % (tp_size * pp_size) == 0, "process grid: the world of ", w.size(), " ranks is not a multiple of --tp ", tp_size,
             " x --pp ", pp_size, " = ", tp_size * pp_size, " (data parallelism takes the quotient)");
    dp_size = w.size() / (tp_size * pp_size);
    const int r = w.rank();
    tp_rank = r % tp_size;
    pp_rank = (r / tp_size) % pp_size;
    dp_rank = r / (tp_size * pp_size);
    tp = w.split(dp_rank * pp_size + pp_rank, tp_rank);
    pp = w.split(dp_rank * tp_size + tp_rank, pp_rank);
    dp = w.split(pp_rank * tp_size + tp_rank, dp_rank);
    model = w.split(dp_rank, pp_rank * tp_size + tp_rank);
  }
  Communicator* world;
  int tp_size = 1, pp_size = 1, dp_size = 1;
  int tp_rank = 0, pp_rank = 0, dp_rank = 0;
  std::unique_ptr<Communicator> tp, pp, dp, model;
};

}  // namespace tg::dist
