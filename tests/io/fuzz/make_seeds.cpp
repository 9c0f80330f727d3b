// tg_fuzz_seeds: writes the seed corpus of fuzz_safetensors: small valid files of every dtype, with and
// without metadata and checksums, an empty file, and a training checkpoint.
//   tg_fuzz_seeds <dir>
#include <cstdio>
#include <string>

#include "typegrad/io/train_state.hpp"
#include "typegrad/optim/optim.hpp"
#include "typegrad/typegrad.hpp"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <dir>\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  try {
    tg::Generator g(1);
    {
      tg::io::SafetensorsWriter w;
      w.add("a", tg::Tensor<float>::normal({2, 3}, 0.f, 1.f, g));
      w.add("b", tg::Tensor<double>::full({2}, 0.5));
      w.add("c", tg::Tensor<float>::normal({3}, 0.f, 1.f, g).to<tg::fp16>());
      w.add("d", tg::Tensor<float>::normal({2, 1, 2}, 0.f, 1.f, g).to<tg::bf16>());
      w.add("e", tg::Tensor<std::int64_t>::arange(3));
      w.add("f", tg::Tensor<std::int32_t>::full({2}, 7));
      w.add("g", tg::Tensor<std::uint8_t>::full({5}, 9));
      w.add("s", tg::Tensor<float>::full({}, 1.0));
      w.add("z", tg::Tensor<float>::empty({0}));
      w.set_metadata("format", "pt");
      w.write(dir + "/all_dtypes.safetensors");
      w.set_checksums(false);
      w.write(dir + "/no_checksums.safetensors");
    }
    tg::io::SafetensorsWriter empty;
    empty.set_checksums(false);
    empty.write(dir + "/empty.safetensors");
    std::vector<tg::optim::Param> params{{"w", tg::Tensor<float>::normal({2, 2}, 0.f, 1.f, g)}, {"b", tg::Tensor<float>::zeros({2})}};
    tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 0.1f});
    tg::sum(tg::mul(params[0].tensor, params[0].tensor)).backward();
    opt.step();
    tg::io::TrainStateRecord rec;
    rec.step = 1;
    rec.scaler = tg::io::ScalerStateRecord{1024.0, 3, 1, 9};
    tg::io::save_train_state(dir + "/checkpoint.safetensors", params, opt, rec);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tg_fuzz_seeds: %s\n", e.what());
    return 1;
  }
}
