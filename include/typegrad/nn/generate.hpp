// Text generation with a GPT: next-token sampling (temperature, top-k, top-p) and a decoder that runs the
// model either over the whole window for every token (the reference) or with a KV cache, so each new token
// costs one position's forward. Both follow one context policy (Note [the decoding window]) and so produce
// the same tokens for the same seed.
//   tg::nn::Decoder dec(model, /*window=*/64);              // KV cache on
//   dec.set_prompt(tok.encode("Once"));
//   for (int i = 0; i < 100; ++i) std::cout << tok.token_bytes(dec.next({.temperature = 0.8f}, gen));
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "typegrad/core/random.hpp"
#include "typegrad/nn/gpt.hpp"
#include "typegrad/ops/concat.hpp"

namespace tg::nn {

/// How the next token is drawn from the model's logits. temperature 0 is greedy (the arg max, no draw);
/// top_k 0 keeps every token; top_p 1 keeps every token of the top-k set.
struct SamplingOptions {
  float temperature = 0.8f;
  std::int64_t top_k = 40;
  double top_p = 1.0;
  void validate() const {
    TG_CHECK(std::isfinite(temperature) && temperature >= 0.f, "sampling: temperature must be a number >= 0, got ", temperature);
    TG_CHECK(top_k >= 0, "sampling: top-k must be >= 0 (0: all tokens), got ", top_k);
    TG_CHECK(top_p > 0.0 && top_p <= 1.0, "sampling: top-p must be in (0, 1], got ", top_p);
  }
};

/// Note [sampling the next token]
/// Tokens are ordered by logit (ties by id), the first top_k kept; their probabilities softmax(logit /
/// temperature) are computed in double; top-p keeps the shortest prefix whose probability reaches top_p of
/// the kept mass (at least one token). One uniform draw u from `gen` picks the token where the running sum
/// first reaches u times the kept mass: so a sampler consumes exactly one draw per token (temperature 0: no
/// draw), whatever the options, and two decoders fed the same logits and seed pick the same tokens.
inline std::int32_t sample_from_logits(std::span<const float> logits, const SamplingOptions& o, Generator& gen) {
  const auto V = static_cast<std::int64_t>(logits.size());
  TG_CHECK(V > 0, "sampling: no logits");
  if (o.temperature == 0.f) {  // greedy
    std::int64_t best = 0;
    for (std::int64_t i = 1; i < V; ++i)
      if (logits[static_cast<std::size_t>(i)] > logits[static_cast<std::size_t>(best)]) best = i;
    return static_cast<std::int32_t>(best);
  }
  std::vector<std::int32_t> order(static_cast<std::size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  const std::int64_t k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](std::int32_t a, std::int32_t b) {
    const float la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  });
  std::vector<double> p(static_cast<std::size_t>(k));
  const double mx = logits[static_cast<std::size_t>(order[0])];
  double z = 0;
  for (std::int64_t i = 0; i < k; ++i)
    z += p[static_cast<std::size_t>(i)] =
        std::exp((static_cast<double>(logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]) - mx) / o.temperature);
  std::int64_t kept = k;
  if (o.top_p < 1.0) {
    double run = 0;
    for (std::int64_t i = 0; i < k; ++i) {
      run += p[static_cast<std::size_t>(i)];
      if (run >= o.top_p * z) {
        kept = i + 1;
        z = run;
        break;
      }
    }
  }
  double u = static_cast<double>(gen.uniform()) * z;
  for (std::int64_t i = 0; i < kept; ++i) {
    u -= p[static_cast<std::size_t>(i)];
    if (u <= 0) return order[static_cast<std::size_t>(i)];
  }
  return order[static_cast<std::size_t>(kept - 1)];
}

/// The keys and values of every layer for the positions decoded so far: (1, H, capacity, hs) per layer,
/// filled up to length().
template <Device D = cpu>
class KVCache {
 public:
  KVCache(const GPTConfig& c, std::int64_t capacity) : capacity_(capacity) {
    TG_CHECK(capacity >= 1 && capacity <= c.block_size, "KVCache: capacity must be in [1, block_size ", c.block_size, "], got ", capacity);
    const std::int64_t hs = c.n_embd / c.n_head;
    for (std::int64_t l = 0; l < c.n_layer; ++l) {
      k_.push_back(Tensor<fp32, D>::zeros({1, c.n_head, capacity, hs}));
      v_.push_back(Tensor<fp32, D>::zeros({1, c.n_head, capacity, hs}));
    }
  }
  std::int64_t length() const { return length_; }
  std::int64_t capacity() const { return capacity_; }
  void clear() { length_ = 0; }
  /// Bytes the cache holds (keys and values of every layer).
  std::int64_t bytes() const { return 2 * static_cast<std::int64_t>(k_.size()) * k_[0].numel() * 4; }

  /// Stores the keys and values (1, H, t, hs) of layer `l` at positions [length, length + t) and returns the
  /// views (1, H, length + t, hs) of everything cached for that layer; advance() then moves length on.
  std::pair<Tensor<fp32, D>, Tensor<fp32, D>> append(std::size_t l, const Tensor<fp32, D>& k, const Tensor<fp32, D>& v) {
    const std::int64_t t = k.size(2);
    TG_CHECK(length_ + t <= capacity_, "KVCache: ", length_, " + ", t, " positions exceed the capacity ", capacity_);
    detail::copy_tensor(k, k_[l].narrow(2, length_, t));
    detail::copy_tensor(v, v_[l].narrow(2, length_, t));
    return {k_[l].narrow(2, 0, length_ + t), v_[l].narrow(2, 0, length_ + t)};
  }
  void advance(std::int64_t t) { length_ += t; }

 private:
  std::vector<Tensor<fp32, D>> k_, v_;
  std::int64_t capacity_ = 0, length_ = 0;
};

/// The logits (V) of the last of `ids`, which continue the cached positions: the model run over positions
/// [cache.length(), cache.length() + ids.size()) only, reading earlier keys and values from the cache and
/// adding these. An empty cache takes any number of ids (the prompt, through the fused causal attention);
/// a non-empty one takes them one at a time (each attends to everything cached).
template <Device D>
Tensor<fp32> forward_cached(const BasicGPT<D>& model, std::span<const std::int32_t> ids, KVCache<D>& cache) {
  NoGrad no_grad;
  TG_CHECK(!ids.empty(), "forward_cached: no tokens");
  if (cache.length() > 0 && ids.size() > 1) {
    Tensor<fp32> last;
    for (std::size_t i = 0; i < ids.size(); ++i) last = forward_cached(model, ids.subspan(i, 1), cache);
    return last;
  }
  const GPTConfig& c = model.config();
  const auto t = static_cast<std::int64_t>(ids.size());
  const std::int64_t past = cache.length(), C = c.n_embd, H = c.n_head, hs = C / H;
  TG_CHECK(past + t <= cache.capacity(), "forward_cached: ", past, " cached + ", t, " new positions exceed the window ", cache.capacity());
  auto idx = Tensor<std::int64_t>::empty({1, t}), pos = Tensor<std::int64_t>::empty({t});
  for (std::int64_t i = 0; i < t; ++i) {
    TG_CHECK(ids[static_cast<std::size_t>(i)] >= 0 && ids[static_cast<std::size_t>(i)] < c.vocab_size, "forward_cached: token ",
             ids[static_cast<std::size_t>(i)], " is outside the model's vocabulary of ", c.vocab_size);
    idx.data()[i] = ids[static_cast<std::size_t>(i)];
    pos.data()[i] = past + i;
  }
  Tensor<fp32, D> x = add(model.wte().template forward<fp32>(idx), model.wpe().template forward<fp32>(pos));  // (1,t,C)
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  for (std::size_t l = 0; l < model.blocks().size(); ++l) {
    const BasicBlock<D>& b = model.blocks()[l];
    const Tensor<fp32, D> qkv = b.attn().c_attn().forward(b.ln_1().forward(x));  // (1,t,3C)
    auto heads = [&](std::int64_t part) { return qkv.narrow(2, part * C, C).reshape({1, t, H, hs}).transpose(1, 2).contiguous(); };
    const Tensor<fp32, D> q = heads(0), k = heads(1), v = heads(2);  // (1,H,t,hs)
    auto [K, Vv] = cache.append(l, k, v);
    // The prompt (empty cache): the causal attention the training forward runs. Afterwards one query sees
    // every cached position, so no mask.
    const Tensor<fp32, D> y = past == 0 ? causal_attention(q, k, v)
                                        : matmul(softmax(mul(matmul(q, K.transpose(-2, -1)), scale)), Vv);  // (1,H,1,hs)
    x = add(x, b.attn().c_proj().forward(y.transpose(1, 2).reshape({1, t, C})));
    x = add(x, b.mlp().forward(b.ln_2().forward(x)));
  }
  cache.advance(t);
  const Tensor<fp32, D> h = model.ln_f().forward(x.narrow(1, t - 1, 1));                   // (1,1,C)
  const Tensor<fp32, D> logits = linear(h, model.wte().weight());                           // (1,1,V)
  return logits.reshape({c.vocab_size}).template to<cpu>().contiguous();  // the host's (a CPU tensor as it is)
}

/// Note [the decoding window]
/// A decoder keeps the context, the tokens the next one is predicted from, within `window` positions (at
/// most the model's block_size; the trainer passes the positions training reached, Note [trained
/// positions]). When a token would not fit, the context drops to its newest keep = max(1, window / 2)
/// tokens, the last drawn one included (a prompt longer than the window is cut to its newest `window`). Sliding by one
/// token instead would shift every position and invalidate a KV cache at every step; dropping half costs
/// one prefill of window/2 positions every window/2 tokens, so a cached token still costs about one
/// position's forward. The full-window decoder follows the same policy, so with the same logits and seed
/// both produce the same tokens (tests/nn/test_generate.cpp).

/// Autoregressive decoding over `model`: with the KV cache (the default) or by re-running the model over
/// the whole context for every token (the reference).
template <Device D = cpu>
class Decoder {
 public:
  Decoder(const BasicGPT<D>& model, std::int64_t window, bool use_cache = true)
      : model_(&model), window_(std::min(window, model.config().block_size)), keep_(std::max<std::int64_t>(1, window_ / 2)),
        use_cache_(use_cache) {
    TG_CHECK(window >= 1, "Decoder: the window must be at least 1 position, got ", window);
    if (use_cache_) cache_.emplace(model.config(), window_);
  }
  /// Starts over from `prompt` (its newest `window` tokens); an empty prompt is an error.
  void set_prompt(std::span<const std::int32_t> prompt) {
    TG_CHECK(!prompt.empty(), "Decoder: the prompt has no tokens");
    const auto n = static_cast<std::int64_t>(prompt.size());
    const std::int64_t from = std::max<std::int64_t>(0, n - window_);
    context_.assign(prompt.begin() + from, prompt.end());
    if (cache_) cache_->clear();
  }
  /// Draws the next token and appends it to the context.
  std::int32_t next(const SamplingOptions& o, Generator& gen) {
    TG_CHECK(!context_.empty(), "Decoder: set a prompt first");
    if (static_cast<std::int64_t>(context_.size()) > window_) {  // the last token did not fit: Note [the decoding window]
      context_.erase(context_.begin(), context_.end() - keep_);
      if (cache_) cache_->clear();
    }
    const Tensor<fp32> logits = use_cache_ ? cached_logits() : full_logits();
    const std::int32_t tok = sample_from_logits(std::span<const float>(logits.data(), static_cast<std::size_t>(logits.numel())), o, gen);
    context_.push_back(tok);
    ++generated_;
    return tok;
  }
  const std::vector<std::int32_t>& context() const { return context_; }
  std::int64_t window() const { return window_; }
  bool uses_cache() const { return use_cache_; }
  /// Positions run through the model so far (prompt prefills and re-prefills included).
  std::int64_t positions_computed() const { return positions_; }
  std::int64_t generated() const { return generated_; }
  const KVCache<D>* cache() const { return cache_ ? &*cache_ : nullptr; }

 private:
  Tensor<fp32> cached_logits() {
    const std::int64_t have = cache_->length(), n = static_cast<std::int64_t>(context_.size());
    positions_ += n - have;
    return forward_cached(*model_, std::span<const std::int32_t>(context_).subspan(static_cast<std::size_t>(have)), *cache_);
  }
  Tensor<fp32> full_logits() {
    NoGrad no_grad;
    const auto T = static_cast<std::int64_t>(context_.size()), V = model_->config().vocab_size;
    auto idx = Tensor<std::int64_t>::empty({1, T});
    for (std::int64_t t = 0; t < T; ++t) idx.data()[t] = context_[static_cast<std::size_t>(t)];
    positions_ += T;
    return model_->template forward<fp32>(idx).narrow(1, T - 1, 1).reshape({V}).template to<cpu>().contiguous();
  }

  const BasicGPT<D>* model_;
  std::int64_t window_, keep_;
  bool use_cache_;
  std::optional<KVCache<D>> cache_;
  std::vector<std::int32_t> context_;
  std::int64_t positions_ = 0, generated_ = 0;
};

/// `tokens` tokens sampled after `prompt` (Note [sampling the next token]) with a KV cache over a window of
/// at most `window` positions (Note [the decoding window]), decoded with `tok` (anything with
/// encode(string) -> ids and decode(span of ids) -> string, e.g. data::AnyTokenizer); returns the prompt and
/// the continuation as text. An empty prompt (or one that encodes to no token) starts from "\n".
template <Device D, class Tokenizer>
std::string generate_text(const BasicGPT<D>& model, const Tokenizer& tok, const std::string& prompt, std::int64_t tokens,
                          const SamplingOptions& options, Generator& gen, std::int64_t window) {
  TG_CHECK(window >= 1, "generate_text: the window must be at least 1 position, got ", window);
  TG_CHECK(tokens >= 0, "generate_text: tokens must be >= 0, got ", tokens);
  std::vector<std::int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids = tok.encode("\n");
  Decoder<D> dec(model, window);
  dec.set_prompt(ids);
  for (std::int64_t s = 0; s < tokens; ++s) ids.push_back(dec.next(options, gen));
  return tok.decode(std::span<const std::int32_t>(ids));
}

}  // namespace tg::nn
