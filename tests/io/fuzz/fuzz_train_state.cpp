// libFuzzer target for the training-state record: the input is the JSON text of the "tg.state" metadata,
// wrapped into an otherwise valid checkpoint (format, format_version, "tg.state.crc32c" of the input,
// per-tensor checksums; parameters "w" [2,3] and "b" [3] with AdamW state), so every input reaches the
// JSON field validation. Then read_train_state_record and load_train_state (into the same parameters and an
// AdamW). Invariants: each either succeeds or throws tg::Error; a record that loads also reads, equal; on
// an error the parameters and the optimizer state are unchanged; an accepted record saves and reads back
// equal. Never a crash, leak or undefined behaviour (built with -fsanitize=fuzzer,address,undefined).
//   fuzz_train_state -runs=100000 corpus/ seeds/          # see tests/io/fuzz/CMakeLists.txt
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "typegrad/io/train_state.hpp"
#include "typegrad/optim/adam.hpp"

namespace {
struct Fixture {
  std::vector<tg::optim::Param> params{{"w", tg::Tensor<float>::empty({2, 3})}, {"b", tg::Tensor<float>::empty({3})}};
  tg::optim::AdamW opt{tg::optim::default_groups(params, 0.1f), {.lr = 0.1f}};
  std::vector<tg::optim::NamedTensor> fresh_state = opt.state_tensors();  // no per-parameter state yet
  // The checkpoint's tensors: the parameters and a step-1 AdamW state, under "optim.".
  std::vector<std::pair<std::string, tg::Tensor<float>>> file_tensors;

  Fixture() {
    float v = 0.5f;
    auto filled = [&](const tg::Shape& s) {
      tg::Tensor<float> t = tg::Tensor<float>::empty(s);
      for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = (v += 0.75f);
      return t;
    };
    for (const auto& p : params) {
      file_tensors.emplace_back(p.name, filled(p.tensor.shape()));
      file_tensors.emplace_back("optim." + p.name + ".exp_avg", filled(p.tensor.shape()));
      file_tensors.emplace_back("optim." + p.name + ".exp_avg_sq", filled(p.tensor.shape()));
      file_tensors.emplace_back("optim." + p.name + ".step", tg::Tensor<float>::full({}, 1.0));
    }
    file_tensors.emplace_back("optim.optimizer.step", tg::Tensor<float>::full({}, 1.0));
  }
  /// Parameters and optimizer as before every input.
  void reset() {
    float v = 100.25f;
    for (const auto& p : params)
      for (std::int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.data()[i] = (v += 1.f);
    opt.load_state(fresh_state);
  }
  /// Everything a load may change, as comparable bytes: parameter values, then each optimizer state entry.
  std::vector<float> snapshot() const {
    std::vector<tg::Tensor<tg::fp32>> ts;
    for (const auto& p : params) ts.push_back(p.tensor);
    for (const auto& e : opt.state_tensors()) ts.push_back(e.tensor);
    std::vector<float> out = tg_fuzz::snapshot(ts);
    out.push_back(static_cast<float>(ts.size()));
    return out;
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

std::string hex8(std::uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Fixture& fx = fixture();
  const std::string state(reinterpret_cast<const char*>(data), size);
  std::vector<std::uint8_t> file;
  try {
    tg::io::SafetensorsWriter w;
    for (const auto& [name, t] : fx.file_tensors) w.add(name, t);
    w.set_metadata("format", "typegrad.train_state");
    w.set_metadata("format_version", "1");
    w.set_metadata("tg.state", state);
    w.set_metadata("tg.state.crc32c", hex8(tg::io::crc32c(state.data(), state.size())));
    file = w.serialize();
  } catch (const tg::Error&) {
    return -1;  // not valid UTF-8: no safetensors header can hold it; not worth keeping in the corpus
  }
  const std::string& path = tg_fuzz::scratch_path("train_state");
  tg_fuzz::write_bytes(path, file.data(), file.size());

  std::optional<tg::io::TrainStateRecord> read;
  try {
    read = tg::io::read_train_state_record(path);
  } catch (const tg::Error&) {
  }

  fx.reset();
  const std::vector<float> before = fx.snapshot();
  std::optional<tg::io::TrainStateRecord> loaded;
  try {
    loaded = tg::io::load_train_state(path, fx.params, fx.opt);
  } catch (const tg::Error&) {
    if (!tg_fuzz::same_bytes(before, fx.snapshot())) __builtin_trap();  // an error must change nothing
  }
  // The record is all that differs between inputs: what loads also reads, as the same record (a record
  // that reads may still not load: e.g. another optimizer's state).
  if (!loaded) return 0;
  if (!read || !(*read == *loaded)) __builtin_trap();

  // An accepted record saves and reads back equal (through the library's own writer).
  const std::string again = path + ".again";
  tg::io::save_train_state(again, fx.params, fx.opt, *loaded);
  const tg::io::TrainStateRecord back = tg::io::read_train_state_record(again);
  std::remove(again.c_str());
  if (!(back == *loaded)) __builtin_trap();
  return 0;
}
