// Everything in typegrad's amp/: precision policies, autocast rules, loss scalers, master weights with
// per-step low-precision copies, and the MixedPrecision setup that bundles them.
//   #include <typegrad/amp/amp.hpp>
//   tg::amp::MixedPrecision<tg::amp::fp16_mixed> amp(params, opt);   // DynamicScaler by default
#pragma once

#include "typegrad/amp/precision.hpp"
#include "typegrad/amp/fp32_matmul.hpp"
#include "typegrad/amp/autocast.hpp"
#include "typegrad/amp/scaler.hpp"
#include "typegrad/amp/weights.hpp"
#include "typegrad/amp/mixed_precision.hpp"
