// Must not compile: an fp16 mixed-precision training setup without a loss scaler.
#include <typegrad/amp/amp.hpp>
#include <typegrad/optim/optim.hpp>
int main() {
  std::vector<tg::optim::Param> params;
  tg::optim::AdamW opt(params, tg::optim::AdamWOptions{});
  // expected: "fp16 compute (fp16_mixed) needs a loss scaler ... Fix: use tg::amp::DynamicScaler ..."
  tg::amp::MixedPrecision<tg::amp::fp16_mixed, tg::amp::NoScaler> amp(params, opt);
  (void)amp;
}
