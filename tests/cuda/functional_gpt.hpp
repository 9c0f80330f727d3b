// A device-generic GPT-2 written with typegrad ops only: nn::GPT's architecture (pre-LN blocks, fused causal
// attention, GELU-tanh MLP, tied LM head, GPT-2 init) with its parameters as a flat list of fp32 tensors on
// device D, and AdamW / SGD written with ops. It exists so the CPU-vs-CUDA training test and the GPU
// benchmark can run a GPT on CUDA before the nn modules take a device parameter; the same seed gives the
// same initial weights on every device (drawn on the host, then copied).
//   tg::testing::FunctionalGpt<tg::cuda> m(cfg, /*seed=*/1);
//   auto loss = m.loss<tg::bf16>(idx, targets);  loss.backward();  m.adamw_step(3e-4);
#pragma once

#include <cmath>
#include <vector>

#include <typegrad/detail/cpu/optim_kernels.hpp>
#include <typegrad/typegrad.hpp>

namespace tg::testing {

struct FunctionalGptConfig {
  std::int64_t vocab = 64, block = 16, layers = 2, heads = 2, embd = 32;
};

template <Device D>
class FunctionalGpt {
 public:
  FunctionalGpt(const FunctionalGptConfig& c, std::uint64_t seed) : c_(c) {
    Generator gen(seed);
    const std::int64_t C = c.embd;
    const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(c.layers));
    add(Tensor<fp32>::normal({c.vocab, C}, 0.f, 0.02f, gen));  // wte (also the LM head)
    add(Tensor<fp32>::normal({c.block, C}, 0.f, 0.02f, gen));  // wpe
    for (std::int64_t l = 0; l < c.layers; ++l) {
      add(Tensor<fp32>::ones({C}));                                   // ln_1.weight
      add(Tensor<fp32>::zeros({C}));                                  // ln_1.bias
      add(Tensor<fp32>::normal({3 * C, C}, 0.f, 0.02f, gen));         // attn.c_attn.weight
      add(Tensor<fp32>::zeros({3 * C}));                              // attn.c_attn.bias
      add(Tensor<fp32>::normal({C, C}, 0.f, proj_std, gen));          // attn.c_proj.weight
      add(Tensor<fp32>::zeros({C}));                                  // attn.c_proj.bias
      add(Tensor<fp32>::ones({C}));                                   // ln_2.weight
      add(Tensor<fp32>::zeros({C}));                                  // ln_2.bias
      add(Tensor<fp32>::normal({4 * C, C}, 0.f, 0.02f, gen));         // mlp.c_fc.weight
      add(Tensor<fp32>::zeros({4 * C}));                              // mlp.c_fc.bias
      add(Tensor<fp32>::normal({C, 4 * C}, 0.f, proj_std, gen));      // mlp.c_proj.weight
      add(Tensor<fp32>::zeros({C}));                                  // mlp.c_proj.bias
    }
    add(Tensor<fp32>::ones({C}));   // ln_f.weight
    add(Tensor<fp32>::zeros({C}));  // ln_f.bias
  }

  std::int64_t num_parameters() const {
    std::int64_t n = 0;
    for (const auto& p : p_) n += p.numel();
    return n;
  }
  const std::vector<Tensor<fp32, D>>& parameters() const { return p_; }

  /// Mean cross-entropy of next-token logits (B,T,V) against targets (B,T), computed in precision T
  /// (fp32 master weights cast once per use, as a mixed-precision policy does).
  template <FloatingElement T>
  Tensor<T, D> loss(const Tensor<std::int64_t>& idx, const Tensor<std::int64_t>& targets) const {
    const std::int64_t B = idx.size(0), Tn = idx.size(1), C = c_.embd, H = c_.heads, hs = C / H;
    auto w = [&](std::size_t i) { return p_[i].template to<T>(); };
    const Tensor<std::int64_t> pos = Tensor<std::int64_t>::arange(Tn);
    Tensor<T, D> x = tg::add(tg::embedding(w(0), idx), tg::embedding(w(1), pos));  // (B,T,C)
    std::size_t k = 2;
    for (std::int64_t l = 0; l < c_.layers; ++l, k += 12) {
      const Tensor<T, D> h1 = tg::layernorm(x, w(k), w(k + 1));
      const Tensor<T, D> qkv = tg::linear(h1, w(k + 2), w(k + 3));  // (B,T,3C)
      auto heads = [&](std::int64_t part) {                          // (B,H,T,hs)
        return qkv.narrow(2, part * C, C).reshape({B, Tn, H, hs}).transpose(1, 2).contiguous();
      };
      const Tensor<T, D> y = tg::causal_attention(heads(0), heads(1), heads(2));
      x = tg::add(x, tg::linear(y.transpose(1, 2).reshape({B, Tn, C}), w(k + 4), w(k + 5)));
      const Tensor<T, D> h2 = tg::layernorm(x, w(k + 6), w(k + 7));
      x = tg::add(x, tg::linear(tg::gelu_tanh(tg::linear(h2, w(k + 8), w(k + 9))), w(k + 10), w(k + 11)));
    }
    x = tg::layernorm(x, w(k), w(k + 1));
    return tg::cross_entropy(tg::linear(x, w(0)), targets);  // tied head: logits = x·wteᵀ
  }

  /// p -= lr·grad (parameters without a gradient are left alone).
  void sgd_step(double lr) {
    NoGrad ng;
    for (auto& p : p_) {
      const Tensor<fp32, D> g = p.grad();
      if (g.defined()) reset(p, tg::sub(p, tg::mul(g, lr)));
    }
  }

  /// AdamW (Loshchilov & Hutter 2019) with bias correction, written with ops: m = β1 m + (1-β1) g,
  /// v = β2 v + (1-β2) g², p -= lr (m̂ / (√v̂ + ε) + λ p).
  void adamw_step(double lr, double beta1 = 0.9, double beta2 = 0.95, double eps = 1e-8, double wd = 0.1) {
    NoGrad ng;
    ++t_;
    if (m_.empty())
      for (const auto& p : p_) {
        m_.push_back(Tensor<fp32, D>::zeros(p.shape()));
        v_.push_back(Tensor<fp32, D>::zeros(p.shape()));
      }
    const double c1 = 1.0 - std::pow(beta1, t_), c2 = 1.0 - std::pow(beta2, t_);
    for (std::size_t i = 0; i < p_.size(); ++i) {
      const Tensor<fp32, D> g = p_[i].grad();
      if (!g.defined()) continue;
      m_[i] = tg::add(tg::mul(m_[i], beta1), tg::mul(g, 1.0 - beta1));
      v_[i] = tg::add(tg::mul(v_[i], beta2), tg::mul(tg::mul(g, g), 1.0 - beta2));
      const Tensor<fp32, D> step = tg::div(tg::mul(m_[i], 1.0 / c1), tg::add(tg::sqrt(tg::mul(v_[i], 1.0 / c2)), eps));
      reset(p_[i], tg::sub(p_[i], tg::mul(tg::add(step, tg::mul(p_[i], wd)), lr)));
    }
  }

  /// The same AdamW update with the backends' fused kernels, in place: backend::cpu::adam_step per tensor
  /// on the CPU, one backend::cuda::adam_step_multi launch on CUDA (both run math::adam_update's formula).
  /// Gradients are cleared afterwards.
  void fused_adamw_step(double lr, double beta1 = 0.9, double beta2 = 0.95, double eps = 1e-8, double wd = 0.1) {
    ++t_;
    if (m_.empty())
      for (const auto& p : p_) {
        m_.push_back(Tensor<fp32, D>::zeros(p.shape()));
        v_.push_back(Tensor<fp32, D>::zeros(p.shape()));
      }
    std::vector<backend::cuda::AdamTensor> list;
    for (std::size_t i = 0; i < p_.size(); ++i) {
      const Tensor<fp32, D> g = p_[i].grad();  // accumulated gradients are contiguous and owned
      if (!g.defined()) continue;
      if constexpr (std::is_same_v<D, cpu>) {
        backend::cpu::AdamScalars s;
        s.lr = lr;
        s.beta1 = beta1;
        s.beta2 = beta2;
        s.eps = eps;
        s.weight_decay = wd;
        s.decoupled = true;
        s.step = t_;
        backend::cpu::adam_step<float>(p_[i].data(), g.data(), m_[i].data(), v_[i].data(), p_[i].numel(), s);
      } else {
        list.push_back({p_[i].data(), g.data(), m_[i].data(), v_[i].data(), p_[i].numel()});
      }
    }
    if constexpr (!std::is_same_v<D, cpu>)
      backend::cuda::adam_step_multi(list.data(), static_cast<int>(list.size()), lr, beta1, beta2, eps, wd, true, t_);
    for (auto& p : p_) p.zero_grad();
  }

 private:
  void add(const Tensor<fp32>& host) {
    Tensor<fp32, D> p;
    if constexpr (std::is_same_v<D, cpu>) p = host.detach();
    else p = host.template to<D>().detach();
    p.requires_grad_();
    p_.push_back(p);
  }
  /// A fresh leaf holding `value` (the old tensor's gradient and history are dropped).
  static void reset(Tensor<fp32, D>& p, const Tensor<fp32, D>& value) {
    p = value.detach();
    p.requires_grad_();
  }

  FunctionalGptConfig c_;
  std::vector<Tensor<fp32, D>> p_, m_, v_;
  int t_ = 0;
};

/// Token ids (B,T) and their next tokens from a fixed synthetic stream t_{i+1} = (5 t_i + 3 + noise) mod V,
/// which a GPT learns quickly; batch `step` reads Philox counters of (seed, step), so every device sees
/// the same batches.
inline std::pair<Tensor<std::int64_t>, Tensor<std::int64_t>> synthetic_batch(std::int64_t B, std::int64_t T,
                                                                             std::int64_t V, std::uint64_t seed,
                                                                             std::uint64_t step) {
  Generator gen(seed);
  gen.set_state(seed, step * static_cast<std::uint64_t>(B * (T + 1)));
  Tensor<std::int64_t> x = Tensor<std::int64_t>::empty({B, T}), y = Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t tok = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(V));
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t noise = gen.uniform() < 0.1f ? 1 : 0;
      const std::int64_t next = (5 * tok + 3 + noise) % V;
      x.data()[b * T + t] = tok;
      y.data()[b * T + t] = next;
      tok = next;
    }
  }
  return {x, y};
}

}  // namespace tg::testing
