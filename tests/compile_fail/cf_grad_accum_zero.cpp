// Must not compile: gradient accumulation over zero micro-batches.
#include <typegrad/typegrad.hpp>
#include <typegrad/optim/grad_accum.hpp>
int main() {
  tg::optim::GradAccum<0> accum;  // expected: "GradAccum<N>: N (micro-batches per optimizer step) must be at least 1"
  (void)accum.n();
}
