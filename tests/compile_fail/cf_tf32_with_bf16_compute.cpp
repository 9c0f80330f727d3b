// TF32 is a mode of fp32 compute: a policy asking for it with bf16 compute must not compile.
#include <typegrad/amp/precision.hpp>

using Bad = tg::amp::Precision<tg::fp32, tg::bf16, tg::fp32, tg::fp32, tg::amp::Fp32Matmul::tf32>;
constexpr bool kInstantiated = Bad::uses_weight_copies;

int main() { return kInstantiated ? 0 : 1; }
