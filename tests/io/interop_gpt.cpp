// tg_safetensors_interop: typegrad's side of safetensors_interop.py (PyTorch interop both ways).
//   tg_safetensors_interop save   V C H T L seed weights.safetensors io.safetensors   # random GPT: weights, idx, logits
//   tg_safetensors_interop logits V C H T L weights.safetensors io.safetensors out.safetensors  # load, run idx
// TG_INTEROP_VOCAB_MULTIPLE=16 stores the model's embedding rows padded to a multiple of 16.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "typegrad/io/train_state.hpp"
#include "typegrad/nn/gpt.hpp"
#include "typegrad/typegrad.hpp"

namespace {

tg::nn::GPTConfig config_from(char** a) {
  tg::nn::GPTConfig c;
  c.vocab_size = std::stoll(a[0]);
  c.n_embd = std::stoll(a[1]);
  c.n_head = std::stoll(a[2]);
  c.block_size = std::stoll(a[3]);
  c.n_layer = std::stoll(a[4]);
  // Note [padded vocabulary]: the embedding's rows stored padded (the files hold the real rows either way).
  if (const char* m = std::getenv("TG_INTEROP_VOCAB_MULTIPLE")) c.vocab_multiple = std::stoll(m);
  return c;
}

tg::Tensor<float> logits_of(const tg::nn::GPT& model, const tg::Tensor<std::int64_t>& idx) {
  tg::NoGrad no_grad;
  return model.forward<tg::fp32>(idx).contiguous();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (cmd == "save" && argc == 10) {
      const auto cfg = config_from(argv + 2);
      tg::Generator gen(std::stoull(argv[7]));
      const tg::nn::GPT model(cfg, gen);
      // GPT-2's init gives nearly uniform logits; spread every parameter (LayerNorm gains around 1) so
      // the comparison exercises every weight.
      for (const auto& p : model.named_parameters()) {
        const bool gain = p.name.find("ln_") != std::string::npos && p.name.ends_with(".weight");
        const auto noise = tg::Tensor<float>::normal(p.tensor.shape(), gain ? 1.f : 0.f, 0.2f, gen);
        std::memcpy(p.tensor.data(), noise.data(), noise.nbytes());
      }
      tg::io::save_weights(argv[8], model.named_parameters(), {{"tg.source", "tg_safetensors_interop"}});
      auto idx = tg::Tensor<std::int64_t>::empty({2, cfg.block_size});
      for (std::int64_t i = 0; i < idx.numel(); ++i) idx.data()[i] = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(cfg.vocab_size));
      tg::io::SafetensorsWriter w;
      w.add("idx", idx);
      w.add("logits", logits_of(model, idx));
      w.write(argv[9]);
      return 0;
    }
    if (cmd == "logits" && argc == 10) {
      const auto cfg = config_from(argv + 2);
      tg::Generator gen(0);
      const tg::nn::GPT model(cfg, gen);
      tg::io::load_weights(argv[7], model.named_parameters());
      const auto in = tg::io::SafetensorsReader::open(argv[8]);
      tg::io::SafetensorsWriter w;
      w.add("logits", logits_of(model, in.get<std::int64_t>("idx")));
      w.write(argv[9]);
      return 0;
    }
    std::fprintf(stderr, "usage: %s save V C H T L seed weights io | logits V C H T L weights io out\n", argv[0]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tg_safetensors_interop: %s\n", e.what());
    return 1;
  }
}
