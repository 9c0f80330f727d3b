// train_gpt --eval-only: the validation loss of a trained model (--init-from), and with --quantize the same
// for its int8 model (Note [int8 quantization]) beside the fp32 and bf16 forwards, with the time of one
// forward of each and the model's size. Nothing is trained.
//   train_gpt --model small --eval-only --init-from ckpt.safetensors --quantize int8 --batch 8 --seq 256
#pragma once

#include "trainer.hpp"

namespace train_gpt {

/// A model seen through a bf16 forward, returning fp32 logits (what train::evaluate calls).
template <class Model>
struct Bf16Forward {
  const Model* model;
  template <tg::FloatingElement T>
  auto forward(const tg::Tensor<std::int64_t>& idx) const {
    return model->template forward<tg::bf16>(idx).template to<T>();
  }
};

template <tg::Device D>
int eval_only(const Options& options) {
  Session<D> s(options);
  const Options& o = s.o;
  const auto& ds = *s.data.ds;
  std::printf("typegrad %s | data: %s (%lld val tokens) | tokenizer: %s\n", TG_VERSION_STRING, ds.source().c_str(),
              static_cast<long long>(ds.val_size()), s.data.tok.describe().c_str());
  std::printf("model %s: L=%lld H=%lld C=%lld V=%lld, %.2fM parameters, weights %s\n", o.model.c_str(), (long long)s.config.n_layer,
              (long long)s.config.n_head, (long long)s.config.n_embd, (long long)s.config.vocab_size,
              tg::nn::count_parameters(s.params) / 1e6, o.init_from.empty() ? "from the seed (no --init-from)" : o.init_from.c_str());
  if constexpr (std::is_same_v<D, tg::cpu>)
    std::printf("sparsity of the blocks' linear weights: %.1f%% | threads: %d\n", 100 * prunable_sparsity(s.params),
                tg::backend::cpu::num_threads());
  const auto eval = s.evaluate();
  std::printf("validation: %lld batches of %lldx%lld tokens\n", (long long)o.eval_batches, (long long)o.batch, (long long)o.seq);
  std::printf("  %-6s %9s %8s %9s %10s %12s\n", "model", "val loss", "bpb", "vs fp32", "size", "forward ms");
  const tg::Tensor<std::int64_t> probe = tg::data::BatchSampler::sequential(ds.validation(), o.batch, o.seq).next().inputs;
  auto time_forward = [&](auto&& forward) {
    return median_ms(5, [&] {
      tg::NoGrad no_grad;
      forward(probe);
      // a GPU forward returns once its kernels are queued: the time is the GPU's only after waiting for them
      if constexpr (std::is_same_v<D, tg::cuda>) tg::backend::cuda::synchronize();
    });
  };
  const std::int64_t float_bytes = 4 * tg::nn::count_parameters(s.params);
  const double fp32_ms = time_forward([&](const auto& idx) { return s.model->template forward<tg::fp32>(idx); });
  auto row = [&](const char* name, const tg::train::Evaluation& e, std::int64_t bytes, double ms) {
    char vs[32] = "-";
    if (std::string(name) != "fp32") std::snprintf(vs, sizeof vs, "%+.2f%%", 100 * (e.loss / eval.loss - 1));
    std::printf("  %-6s %9.4f %8.4f %9s %10s %12.2f\n", name, e.loss, e.bits_per_byte, vs, human_bytes(bytes).c_str(), ms);
  };
  row("fp32", eval, float_bytes, fp32_ms);
  {
    if (o.quantize.empty()) return 0;
    double bf16_ms = 0;
    {
      const tg::amp::WeightCopies<tg::bf16, D> copies(s.params);  // the per-step copies a bf16 run reads
      const Bf16Forward<tg::nn::BasicGPT<D>> bf16{s.model.get()};
      const auto e = tg::train::evaluate(bf16, ds, o.batch, o.seq, o.eval_batches, s.data.tok.token_byte_lengths());
      bf16_ms = time_forward([&](const auto& idx) { return s.model->template forward<tg::bf16>(idx); });
      row("bf16", e, float_bytes / 2, bf16_ms);
    }
    const bool is_static = o.quantize == "int8-static";
    std::vector<tg::Tensor<std::int64_t>> calibration;
    if (is_static) {  // training batches, never the validation ones the loss is measured on
      tg::data::BatchSampler cal(ds.train(), o.batch, o.seq, o.seed + 4);
      for (std::int64_t i = 0; i < o.calibration_batches; ++i) calibration.push_back(cal.next().inputs);
    }
    // Quantized (and calibrated) on the host; on a GPU the int8 model is then copied there (Note [int8 GEMM on the GPU]).
    std::optional<tg::nn::GPT> host_copy;
    const tg::nn::GPT& host = [&]() -> const tg::nn::GPT& {
      if constexpr (std::is_same_v<D, tg::cpu>) return *s.model;
      else return host_copy.emplace(*s.model);
    }();
    const tg::quant::QuantizedGPT q = tg::quant::quantize(
        host,
        {.activations = is_static ? tg::quant::ActivationScheme::static_per_tensor : tg::quant::ActivationScheme::dynamic_per_token,
         .lm_head = o.quantize_lm_head},
        calibration);
    using QModel = std::conditional_t<std::is_same_v<D, tg::cpu>, const tg::quant::QuantizedGPT&, const tg::quant::CudaQuantizedGPT>;
    QModel qm(q);
    const auto e = tg::train::evaluate(qm, ds, o.batch, o.seq, o.eval_batches, s.data.tok.token_byte_lengths());
    const double int8_ms = time_forward([&](const auto& idx) { return qm.template forward<tg::fp32>(idx); });
    row("int8", e, q.bytes(), int8_ms);
    std::printf("int8: %s activation scales%s, LM head %s; GEMM kernel %s\n",
                is_static ? "static (calibrated on training batches)" : "per-token dynamic",
                is_static ? (" over " + std::to_string(o.calibration_batches) + " batches").c_str() : "",
                o.quantize_lm_head ? "int8" : "fp32",
                std::is_same_v<D, tg::cpu> ? tg::backend::cpu::gemm_int8_kernel_name().c_str() : "cuBLASLt int8 (IMMA)");
    std::printf("forward speed: int8 %.2fx bf16, %.2fx fp32 (%lldx%lld tokens, median of 5)\n", bf16_ms / int8_ms, fp32_ms / int8_ms,
                (long long)o.batch, (long long)o.seq);
    if (!o.quantize_save.empty()) {
      q.save(o.quantize_save);
      std::printf("saved the int8 model to %s\n", o.quantize_save.c_str());
    }
  }
  return 0;
}

}  // namespace train_gpt
