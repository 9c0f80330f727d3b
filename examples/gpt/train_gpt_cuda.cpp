// train_gpt's GPU runs (Note [training on a GPU], trainer.hpp): train<P, C, cuda> for every precision and
// checkpointing choice, compiled in their own translation unit beside the CPU ones (train_gpt.cpp, whose
// loop this file includes).
//   train_gpt --device cuda --precision bf16
#define TRAIN_GPT_LOOP_ONLY
#include "train_gpt.cpp"

#define TRAIN_GPT_GPU_RUN(P, C) template int train_gpt::train<P, C, tg::cuda>(const train_gpt::Options&, tg::capture::MemoryPlan*);
TRAIN_GPT_RUNS(TRAIN_GPT_GPU_RUN)
