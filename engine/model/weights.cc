#include "engine/model/weights.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvlens {

absl::Status CheckShape(absl::string_view tensor_name, const WeightView& w, int64_t rows,
                        int64_t cols) {
  if (w.empty()) return absl::NotFoundError(absl::StrCat("missing tensor ", tensor_name));
  if (w.rows != rows || w.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor_name, ": expected shape [",
                                                   rows, ", ", cols, "], got [", w.rows, ", ",
                                                   w.cols, "]"));
  }
  return absl::OkStatus();
}

kernels::RopeSpec RopeOf(const ModelConfig& c, const Weights& w, int layer) {
  kernels::RopeSpec rope;
  rope.style = c.rope_style;
  if (c.rope_theta_windowed > 0.0 && c.WindowOf(layer) > 0) {
    rope.theta = c.rope_theta_windowed;
    return rope;
  }
  rope.theta = c.rope_theta;
  if (!w.rope_freqs.empty()) rope.freq_factors = static_cast<const float*>(w.rope_freqs.data);
  return rope;
}

std::string LinearWeightDTypes(const Weights& w) {
  std::map<kernels::DType, int64_t> elements;
  auto add = [&](const WeightView& v) {
    if (!v.empty()) elements[v.dtype] += v.rows * v.cols;
  };
  for (const LayerWeights& l : w.layers) {
    for (const WeightView* v : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_in, &l.w_up, &l.w_out}) add(*v);
  }
  add(w.output);
  std::vector<std::pair<int64_t, std::string>> by_size;
  for (const auto& [dtype, n] : elements) by_size.emplace_back(-n, kernels::DTypeName(dtype));
  std::sort(by_size.begin(), by_size.end());
  std::string out;
  for (const auto& [n, name] : by_size) absl::StrAppend(&out, out.empty() ? "" : "+", name);
  return out;
}

}  // namespace kvlens
