// A GPT's shape as JSON, as training checkpoints record it (TrainStateRecord::model_json), so a program
// that only has the checkpoint (examples/gpt/generate.cpp) can rebuild the model.
//   std::string j = tg::io::gpt_config_json(model.config());
//   tg::nn::GPTConfig c = tg::io::gpt_config_from_json(j, "ckpt-00000100.safetensors");
#pragma once

#include <string>
#include <string_view>

#include "typegrad/nn/gpt.hpp"

namespace tg::io {

/// {"vocab_size":..,"block_size":..,"n_layer":..,"n_head":..,"n_embd":..,"dropout":..}, and "vocab_multiple" when
/// the embedding's rows are stored padded (Note [padded vocabulary]; absent: 1).
std::string gpt_config_json(const nn::GPTConfig& c);
/// The inverse; every field must be present and valid (GPTConfig::validate), else an error naming `origin`.
nn::GPTConfig gpt_config_from_json(std::string_view json, const std::string& origin);

}  // namespace tg::io
