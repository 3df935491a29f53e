// Draws for the CUDA backend's fuzz tests (attention_fuzz_test.cc, products_fuzz_test.cc):
// one of a list, an integer in a range, and documents packed over a sequence's keys.
#ifndef KVLENS_TESTS_KERNELS_CUDA_RANDOM_DRAWS_H_
#define KVLENS_TESTS_KERNELS_CUDA_RANDOM_DRAWS_H_

#include <algorithm>
#include <initializer_list>
#include <random>
#include <vector>

namespace kvlens::kernels::cuda::fuzz {

template <typename T>
T Pick(std::mt19937_64& rng, std::initializer_list<T> xs) {
  std::uniform_int_distribution<size_t> d(0, xs.size() - 1);
  return *(xs.begin() + d(rng));
}

inline int Uniform(std::mt19937_64& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

// Documents of 1 … keys keys each, in order, covering all `keys`.
inline std::vector<int> DocLengths(std::mt19937_64& rng, int keys) {
  std::vector<int> lengths;
  for (int left = keys; left > 0;) {
    const int len = std::min(left, Uniform(rng, 1, keys));
    lengths.push_back(len);
    left -= len;
  }
  return lengths;
}

}  // namespace kvlens::kernels::cuda::fuzz

#endif  // KVLENS_TESTS_KERNELS_CUDA_RANDOM_DRAWS_H_
