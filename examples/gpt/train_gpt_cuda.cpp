// train_gpt's GPU path (Note [training on a GPU], trainer.hpp), in its own translation unit so the CUDA
// instantiations of the model and the loop compile next to the CPU ones, once per precision.
//   train_gpt --device cuda --precision bf16
#include "trainer.hpp"

namespace train_gpt {

template <class Policy>
int train_on_cuda(Run& r, const tg::nn::GPT& model, const std::optional<tg::io::ScalerStateRecord>& saved_scaler) {
  // The GPU model starts from the host model, after --init-from / --resume, and the optimizer from the
  // host optimizer's (possibly loaded) state.
  const tg::nn::BasicGPT<tg::cuda> gpu_model(model);
  const auto gpu_params = gpu_model.named_parameters();
  const auto gpu_opt = make_device_optimizer<tg::cuda>(r.o, gpu_params);  // make_optimizer's settings
  gpu_opt->load_state(r.host_opt.state_tensors());
  // Policy, its default loss scaler and per-step 16-bit weight copies on the GPU, converted here from the
  // loaded masters (after load_state, so the copies match the optimizer's restored step count).
  tg::amp::MixedPrecision<Policy, tg::amp::default_scaler_t<Policy>, tg::cuda> amp(gpu_params, *gpu_opt);
  restore_scaler_or_warn(amp.scaler, saved_scaler);
  auto sync_host = [&] {  // before each checkpoint: the GPU's weights and state into the host objects
    tg::nn::copy_parameter_values(gpu_params, r.params);
    r.host_opt.load_state(gpu_opt->state_tensors());
  };
  return train<tg::cuda>(r, gpu_model, *gpu_opt, amp, sync_host);
}

template int train_on_cuda<tg::amp::fp32_policy>(Run&, const tg::nn::GPT&, const std::optional<tg::io::ScalerStateRecord>&);
template int train_on_cuda<tg::amp::bf16_mixed>(Run&, const tg::nn::GPT&, const std::optional<tg::io::ScalerStateRecord>&);
template int train_on_cuda<tg::amp::fp16_mixed>(Run&, const tg::nn::GPT&, const std::optional<tg::io::ScalerStateRecord>&);

}  // namespace train_gpt
