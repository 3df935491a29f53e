// The model the interpretability benches time (interpret_bench.cc, patch_sweep_bench.cc):
// Llama-shaped with random f32 weights, D 512, 8 layers, 8 heads of 64, FFN 1376, vocab
// 4096, up to 1024 positions (tests/engine/interpret/tiny_model.h builds it).
#ifndef KVLENS_BENCH_INTERPRET_BENCH_MODEL_H_
#define KVLENS_BENCH_INTERPRET_BENCH_MODEL_H_

#include <memory>

#include "tests/engine/interpret/tiny_model.h"

namespace kvlens::bench {

inline testing::TinySpec InterpretBenchSpec() {
  testing::TinySpec spec;
  spec.arch = Architecture::kLlama;
  spec.dim = 512;
  spec.heads = 8;
  spec.kv_heads = 8;
  spec.hidden = 1376;
  spec.layers = 8;
  spec.vocab = 4096;
  spec.max_seq = 1024;
  return spec;
}

}  // namespace kvlens::bench

#endif  // KVLENS_BENCH_INTERPRET_BENCH_MODEL_H_
