// generate: text from a GPT trained with train_gpt, loaded from one of its checkpoints (a file, or the newest
// in a --save-dir): the model's shape, its tokenizer and the positions training reached all come from the
// checkpoint. Streams tokens as they are drawn; a KV cache makes each token one position's forward.
//   generate --checkpoint runs/tiny --prompt "Once upon a time" --tokens 300 --temperature 0.8 --top-p 0.95
//   generate --checkpoint runs/tiny --interactive          # a prompt per line on stdin, until end of input
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include <typegrad/data/tokenizer.hpp>
#include <typegrad/io/model_config.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/generate.hpp>
#include <typegrad/typegrad.hpp>

namespace {

struct Options {
  std::string checkpoint;
  std::string prompt = "\n";
  bool interactive = false;
  std::int64_t tokens = 200;
  float temperature = 0.8f;
  std::int64_t top_k = 40;
  double top_p = 1.0;
  std::string seed = "1337";
  bool no_cache = false;
  std::int64_t window = 0;  // 0: the positions training reached
  int threads = 0;
};

/// A trained model ready to sample from, with everything the checkpoint says about it.
struct Loaded {
  std::string path;
  tg::nn::GPTConfig config;
  std::unique_ptr<tg::nn::GPT> model;
  tg::data::AnyTokenizer tok;
  std::int64_t trained_positions = 0;  // Note [trained positions]
  std::int64_t step = 0;
};

Loaded load(const std::string& dir_or_file) {
  Loaded l;
  tg::io::ResumeChoice choice;
  try {
    choice = tg::io::choose_resume(dir_or_file);
  } catch (const tg::Error& e) {  // its messages name --resume, the trainer's flag
    std::string msg = e.what();
    if (msg.rfind("--resume", 0) == 0) msg = "--checkpoint" + msg.substr(8);
    throw tg::Error(msg);
  }
  l.path = choice.path;
  const tg::io::TrainStateRecord r = choice.record ? *choice.record : tg::io::read_train_state_record(l.path);
  if (r.model_json.empty())
    throw tg::Error("--checkpoint: ", l.path, " does not record the model's shape (written by an older train_gpt); "
                    "generate needs a checkpoint from this version's train_gpt --save-dir");
  l.config = tg::io::gpt_config_from_json(r.model_json, l.path);
  l.config.dropout = 0.f;
  // A checkpoint without a tokenizer was written by a byte-level run.
  l.tok = r.tokenizer_json.empty() ? tg::data::AnyTokenizer{} : tg::data::AnyTokenizer::from_json(r.tokenizer_json);
  if (l.tok.vocab_size() != l.config.vocab_size)
    throw tg::Error("--checkpoint: ", l.path, ": its tokenizer has ", l.tok.vocab_size(), " tokens but the model ",
                    l.config.vocab_size);
  tg::Generator init(0);
  l.model = std::make_unique<tg::nn::GPT>(l.config, init);
  tg::io::load_weights(l.path, l.model->named_parameters());
  auto it = r.scalars.find("trained_positions");
  l.trained_positions = it != r.scalars.end() ? static_cast<std::int64_t>(it->second) : l.config.block_size;
  l.step = r.step;
  return l;
}

/// Generates `o.tokens` tokens after `prompt`, writing each token's bytes to stdout as it is drawn; returns
/// the seconds spent and the positions computed.
std::pair<double, std::int64_t> stream(const Loaded& l, tg::nn::Decoder<tg::cpu>& dec, const std::string& prompt,
                                       const Options& o, tg::Generator& gen) {
  std::vector<std::int32_t> ids = l.tok.encode(prompt);
  if (ids.empty()) ids = l.tok.encode("\n");
  dec.set_prompt(ids);
  const tg::nn::SamplingOptions s{o.temperature, o.top_k, o.top_p};
  const std::int64_t before = dec.positions_computed();
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t i = 0; i < o.tokens; ++i) {
    const std::string bytes = l.tok.token_bytes(dec.next(s, gen));
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::fflush(stdout);
  }
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), dec.positions_computed() - before};
}

int run(const Options& o) {
  if (o.threads > 0) tg::backend::cpu::set_num_threads(o.threads);
  const tg::nn::SamplingOptions sampling{o.temperature, o.top_k, o.top_p};
  sampling.validate();
  std::uint64_t seed = 0;
  try {
    std::size_t used = 0;
    seed = std::stoull(o.seed, &used, 10);
    if (used != o.seed.size() || o.seed.front() == '-') throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw tg::Error("--seed must be a whole number from 0 to 2^64-1, got '", o.seed, "'");
  }
  TG_CHECK(o.tokens >= 1, "--tokens must be at least 1, got ", o.tokens);
  TG_CHECK(o.window >= 0, "--window must be >= 0 (0: the positions training reached), got ", o.window);
  const Loaded l = load(o.checkpoint);
  std::int64_t window = std::min(l.config.block_size, l.trained_positions);
  if (o.window > 0) {
    if (o.window > window)
      std::fprintf(stderr, "warning: --window %lld reaches positions training did not (it reached %lld)\n",
                   static_cast<long long>(o.window), static_cast<long long>(l.trained_positions));
    window = std::min(o.window, l.config.block_size);
  }
  std::fprintf(stderr, "%s: step %lld, L=%lld H=%lld C=%lld, %s; window %lld positions, %s\n", l.path.c_str(),
               static_cast<long long>(l.step), static_cast<long long>(l.config.n_layer), static_cast<long long>(l.config.n_head),
               static_cast<long long>(l.config.n_embd), l.tok.describe().c_str(), static_cast<long long>(window),
               o.no_cache ? "full-window decoding (no KV cache)" : "KV cache");
  tg::nn::Decoder<tg::cpu> dec(*l.model, window, !o.no_cache);
  tg::Generator gen(seed);
  auto report = [&](std::pair<double, std::int64_t> r) {
    std::fprintf(stderr, "\n[%lld tokens in %.2f s: %.1f tokens/s; %lld positions computed]\n", static_cast<long long>(o.tokens),
                 r.first, static_cast<double>(o.tokens) / std::max(r.first, 1e-9), static_cast<long long>(r.second));
  };
  if (!o.interactive) {
    std::fwrite(o.prompt.data(), 1, o.prompt.size(), stdout);
    report(stream(l, dec, o.prompt, o, gen));
    return 0;
  }
  const bool tty = isatty(fileno(stdin));
  std::string line;
  while (true) {
    if (tty) std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line)) break;
    if (line.empty()) continue;
    std::fwrite(line.data(), 1, line.size(), stdout);
    report(stream(l, dec, line, o, gen));
    std::fputc('\n', stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"generate: text from a checkpoint of train_gpt"};
  app.add_option("--checkpoint", o.checkpoint, "a checkpoint file, or a --save-dir (its newest checkpoint)")->required();
  app.add_option("--prompt", o.prompt, "text to continue (default: a newline)");
  app.add_flag("--interactive", o.interactive, "read prompts from stdin, one per line, until end of input");
  app.add_option("--tokens", o.tokens, "tokens to generate per prompt");
  app.add_option("--temperature", o.temperature, "sampling temperature (0: greedy)");
  app.add_option("--top-k", o.top_k, "sample from the k most likely tokens (0: all)");
  app.add_option("--top-p", o.top_p, "sample from the smallest set of likeliest tokens holding this probability (1: all)");
  app.add_option("--seed", o.seed, "seed of the draws (0 to 2^64-1)");
  app.add_option("--window", o.window, "context positions (default: the positions training reached)");
  app.add_flag("--no-cache", o.no_cache, "recompute the whole window for every token (the reference for the KV cache)");
  app.add_option("--threads", o.threads, "OpenMP threads (0: every CPU this process may use)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "generate: error: %s (--help lists the flags)\n", e.what());
    return 2;
  }
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "generate: error: %s\n", e.what());
    return 2;
  }
}
