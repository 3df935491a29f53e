// A test prompt of random token ids: BOS (1), then ids drawn uniformly from [3, vocab) by
// std::mt19937(seed), so the same arguments give the same ids on every machine.
#ifndef KVLENS_TESTS_ENGINE_RANDOM_TOKENS_H_
#define KVLENS_TESTS_ENGINE_RANDOM_TOKENS_H_

#include <cstdint>
#include <random>
#include <vector>

namespace kvlens::testing {

inline std::vector<int32_t> RandomTokens(int n, uint32_t seed, int vocab) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t = {1};
  while (static_cast<int>(t.size()) < n) t.push_back(static_cast<int32_t>(3 + rng() % (vocab - 3)));
  return t;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_RANDOM_TOKENS_H_
