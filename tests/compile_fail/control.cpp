// Positive control for the compile-fail cases: the correct spelling of each rejected call compiles.
#include <typegrad/typegrad.hpp>
#include <typegrad/optim/grad_accum.hpp>
#include <typegrad/amp/amp.hpp>
#include <typegrad/optim/optim.hpp>

int main() {
  auto a = tg::Tensor<tg::bf16>::ones({2, 3});
  auto b = tg::Tensor<tg::fp32>::ones({2, 3});
  auto c = tg::add(a, b.to<tg::bf16>());         // cf_mixed_precision: convert explicitly
  auto d = tg::mul(a.to<tg::fp32>(), b);         // cf_mixed_precision_mul
  tg::Tensor<tg::fp32, tg::cuda> g;
  auto e = tg::mul(b, g.to<tg::cpu>());          // cf_mixed_device: move explicitly
  auto f = tg::add(g.to<tg::cpu>(), b);          // cf_mixed_device_add (ops on two CUDA tensors: not yet)
  auto h = b.to<tg::fp16>();                     // cf_to_not_element_or_device: an element type...
  auto i = b.to<tg::cpu>();                      // ...or a device tag
  float x = g.to<tg::cpu>().at({0, 0});          // cf_at_on_device: copy to the host first
  tg::optim::GradAccum<1> accum;                 // cf_grad_accum_zero: N >= 1
  auto k = tg::checkpoint<tg::RecomputeAll>([](const tg::Tensor<tg::fp32>& t) { return tg::mul(t, t); }, b);  // cf_checkpoint_not_tensor
  std::vector<tg::optim::Param> params;
  tg::optim::AdamW opt(params, tg::optim::AdamWOptions{});
  tg::amp::MixedPrecision<tg::amp::fp16_mixed> amp16(params, opt);                      // cf_fp16_without_scaler:
  tg::amp::MixedPrecision<tg::amp::fp16_mixed, tg::amp::StaticScaler> amp16s(params, opt);  // a scaler, or bf16
  tg::amp::MixedPrecision<tg::amp::bf16_mixed, tg::amp::NoScaler> amp_bf16(params, opt);
  (void)c, (void)d, (void)e, (void)f, (void)h, (void)i, (void)x, (void)accum, (void)amp16, (void)amp16s, (void)amp_bf16, (void)k;
  return 0;
}
