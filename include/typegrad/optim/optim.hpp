// Everything in typegrad's optim/: parameters and groups, the one optimizer hierarchy (BasicOptimizer<D>:
// SGD, Adam, AdamW, LAMB, Adafactor on any device), LR schedules, gradient clipping and accumulation.
//   #include <typegrad/optim/optim.hpp>
//   tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 6e-4f});  tg::optim::GradAccum<8> accum;
#pragma once

#include "typegrad/optim/param.hpp"
#include "typegrad/optim/optimizer.hpp"
#include "typegrad/optim/sgd.hpp"
#include "typegrad/optim/adam.hpp"
#include "typegrad/optim/lamb.hpp"
#include "typegrad/optim/adafactor.hpp"
#include "typegrad/optim/schedule.hpp"
#include "typegrad/optim/clip.hpp"
#include "typegrad/optim/grad_accum.hpp"
#include "typegrad/optim/offload.hpp"
