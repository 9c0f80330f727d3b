// tg_fuzz_seeds: writes the seed corpus of one libFuzzer target (tests/io/fuzz):
//   safetensors   small valid files of every dtype, with and without metadata and checksums, an empty
//                 file, and a training checkpoint (fuzz_safetensors)
//   load_weights  files for the parameters "w" [2,3], "b" [3], "s" []: weights with and without
//                 checksums, fp16/bf16/fp64 weights, a training checkpoint, and near misses (a wrong
//                 shape, a missing or an extra tensor, an integer dtype) (fuzz_load_weights)
//   train_state   the "tg.state" JSON text of real checkpoints (saved by save_train_state) and edited
//                 variants, each a file (fuzz_train_state)
//   tg_fuzz_seeds <dir> [safetensors|load_weights|train_state]     # default: safetensors
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "typegrad/io/train_state.hpp"
#include "typegrad/optim/optim.hpp"
#include "typegrad/typegrad.hpp"

namespace {
using json = nlohmann::json;

/// One AdamW step on `params` (so the optimizer has state to save).
void adamw_step(std::vector<tg::optim::Param>& params, tg::optim::AdamW& opt) {
  tg::Tensor<float> loss = tg::sum(tg::mul(params[0].tensor, params[0].tensor));
  for (std::size_t i = 1; i < params.size(); ++i) loss = tg::add(loss, tg::sum(params[i].tensor));
  loss.backward();
  opt.step();
  opt.zero_grad();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) throw tg::Error("tg_fuzz_seeds: cannot write ", path);
}

void safetensors_seeds(const std::string& dir, tg::Generator& g) {
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
  adamw_step(params, opt);
  tg::io::TrainStateRecord rec;
  rec.step = 1;
  rec.scaler = tg::io::ScalerStateRecord{1024.0, 3, 1, 9};
  tg::io::save_train_state(dir + "/checkpoint.safetensors", params, opt, rec);
}

// The parameters of fuzz_load_weights.cpp: keep the two in step.
std::vector<tg::optim::Param> load_weights_params(tg::Generator& g) {
  return {{"w", tg::Tensor<float>::normal({2, 3}, 0.f, 1.f, g)},
          {"b", tg::Tensor<float>::normal({3}, 0.f, 1.f, g)},
          {"s", tg::Tensor<float>::full({}, 0.5)}};
}

void load_weights_seeds(const std::string& dir, tg::Generator& g) {
  auto params = load_weights_params(g);
  tg::io::save_weights(dir + "/weights.safetensors", params);
  {
    tg::io::SafetensorsWriter w;
    for (const auto& p : params) w.add(p.name, p.tensor);
    w.set_checksums(false);
    w.write(dir + "/weights_no_checksums.safetensors");
  }
  {
    tg::io::SafetensorsWriter w;  // floating dtypes that load_weights converts
    w.add("w", params[0].tensor.to<tg::fp16>());
    w.add("b", params[1].tensor.to<tg::bf16>());
    w.add("s", params[2].tensor.to<double>());
    w.write(dir + "/weights_converted.safetensors");
  }
  {
    tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 0.1f});
    adamw_step(params, opt);
    tg::io::TrainStateRecord rec;
    rec.step = 1;
    tg::io::save_train_state(dir + "/checkpoint.safetensors", params, opt, rec);
  }
  {
    tg::io::SafetensorsWriter w;  // near misses: each is one edit away from loading
    w.add("w", tg::Tensor<float>::zeros({3, 2}));
    w.add("b", params[1].tensor);
    w.add("s", params[2].tensor);
    w.write(dir + "/wrong_shape.safetensors");
  }
  {
    tg::io::SafetensorsWriter w;
    w.add("w", params[0].tensor);
    w.add("b", params[1].tensor);
    w.write(dir + "/missing.safetensors");
    w.add("s", params[2].tensor);
    w.add("x", tg::Tensor<float>::zeros({1}));
    w.write(dir + "/extra.safetensors");
  }
  {
    tg::io::SafetensorsWriter w;
    w.add("w", tg::Tensor<std::int32_t>::full({2, 3}, 1));
    w.add("b", params[1].tensor);
    w.add("s", params[2].tensor);
    w.write(dir + "/int_dtype.safetensors");
  }
}

void train_state_seeds(const std::string& dir, tg::Generator& g) {
  std::vector<tg::optim::Param> params{{"w", tg::Tensor<float>::normal({2, 3}, 0.f, 1.f, g)},
                                       {"b", tg::Tensor<float>::normal({3}, 0.f, 1.f, g)}};
  tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 0.1f});
  adamw_step(params, opt);
  const std::string ckpt = dir + "/.checkpoint.tmp.safetensors";
  auto state_of = [&](const tg::io::TrainStateRecord& rec) {
    tg::io::save_train_state(ckpt, params, opt, rec);
    const auto text = tg::io::SafetensorsReader::open(ckpt).metadata_value("tg.state");
    if (!text) throw tg::Error("tg_fuzz_seeds: the checkpoint has no tg.state");
    return *text;
  };
  tg::io::TrainStateRecord plain;
  plain.step = 1;
  const std::string minimal = state_of(plain);
  write_text(dir + "/minimal.json", minimal);

  tg::io::TrainStateRecord full;
  full.step = 12;
  full.schedule_step = 12;
  full.sampler = {7, 24};
  full.generators = {{"init", {7, 0}}, {"dropout", {8, 4096}}, {"sample", {9, 17}}};
  full.grad_accum = tg::io::GradAccumRecord{2, 0, 12};
  full.scaler = tg::io::ScalerStateRecord{32768.0, 5, 2, 14};
  full.scalars = {{"loss_avg", 3.25}, {"tokens", 12288.0}};
  full.config_json = R"({"lr":0.0006,"batch":4,"seq":32,"precision":"fp16","dropout":0.1,"name":"tiny"})";
  const std::string text = state_of(full);
  std::remove(ckpt.c_str());
  write_text(dir + "/full.json", text);

  // Edited variants of the full record (json edits keep whatever fields this build's writer adds).
  const json j = json::parse(text);
  auto variant = [&](const char* name, auto edit) {
    json v = j;
    edit(v);
    write_text(dir + "/" + name + ".json", v.dump());
  };
  variant("other_optimizer", [](json& v) { v["optimizer"] = "Adam"; });
  variant("accum_inconsistent", [](json& v) { v["grad_accum"]["micro_index"] = 2; });
  variant("negative_step", [](json& v) { v["step"] = -1; });
  variant("huge_seed", [](json& v) { v["sampler"]["seed"] = 18446744073709551615ull; });
  variant("float_step", [](json& v) { v["schedule_step"] = 1.5; });
  variant("nulls", [](json& v) { v["scaler"] = nullptr; v["grad_accum"] = nullptr; });
  variant("missing_field", [](json& v) { v.erase("sampler"); });
  variant("wrong_types", [](json& v) { v["generators"] = json::array(); v["config"] = "x"; });
  variant("scalar_string", [](json& v) { v["scalars"]["loss_avg"] = "3.25"; });
  write_text(dir + "/not_json.json", text.substr(0, text.size() / 2));
  write_text(dir + "/array.json", "[" + minimal + "]");
}
}  // namespace

int main(int argc, char** argv) {
  const std::string kind = argc == 3 ? argv[2] : "safetensors";
  if ((argc != 2 && argc != 3) || (kind != "safetensors" && kind != "load_weights" && kind != "train_state")) {
    std::fprintf(stderr, "usage: %s <dir> [safetensors|load_weights|train_state]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  try {
    tg::Generator g(1);
    if (kind == "safetensors") safetensors_seeds(dir, g);
    else if (kind == "load_weights") load_weights_seeds(dir, g);
    else train_state_seeds(dir, g);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tg_fuzz_seeds: %s\n", e.what());
    return 1;
  }
}
