// typegrad: compile-time typed tensors and tape autodiff for training transformer language models.
//   #include <typegrad/typegrad.hpp>
//   auto w = tg::Tensor<tg::fp32>::normal({3, 4}).requires_grad_();  tg::sum(w * w).backward();
#pragma once

#include "typegrad/config.hpp"
#include "typegrad/core/allocator.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/core/device.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/random.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/autodiff/tape.hpp"
#include "typegrad/autodiff/node.hpp"
#include "typegrad/ops/reduce.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/print.hpp"
#include "typegrad/ops/unary.hpp"
#include "typegrad/ops/dropout.hpp"
#include "typegrad/ops/masked_fill.hpp"
#include "typegrad/ops/concat.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/ops/softmax.hpp"
#include "typegrad/ops/layernorm.hpp"
#include "typegrad/ops/embedding.hpp"
#include "typegrad/ops/cross_entropy.hpp"
#include "typegrad/ops/attention.hpp"
