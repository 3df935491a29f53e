#include "engine/interpret/sae.h"

#include <algorithm>
#include <iterator>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvlens::interpret {
namespace {

kernels::WeightView View(const std::vector<float>& v, int64_t rows, int64_t cols) {
  return kernels::WeightView{v.data(), kernels::DType::kF32, rows, cols};
}

// The hooks an SAE may read: [D] rows of the stream, or z's [H·Dh].
constexpr Hook kSaeHooks[] = {Hook::kResidPre, Hook::kResidMid, Hook::kResidPost,
                              Hook::kAttnOut,  Hook::kMlpOut,   Hook::kZ};

}  // namespace

std::string_view SaeArchitectureName(SaeArchitecture a) {
  switch (a) {
    case SaeArchitecture::kStandard:
      return "standard";
    case SaeArchitecture::kJumpRelu:
      return "jumprelu";
    case SaeArchitecture::kTopK:
      return "topk";
  }
  return "?";
}

kernels::WeightView Sae::EncView() const { return View(enc, d_sae, d_in); }
kernels::WeightView Sae::BEncView() const { return View(b_enc, 1, d_sae); }
kernels::WeightView Sae::DecView() const { return View(dec, d_in, d_sae); }
kernels::WeightView Sae::BDecView() const { return View(b_dec, 1, d_in); }

absl::Status ParseSaeHook(std::string_view name, Hook* hook, int* layer) {
  // Only the full name: it carries the layer.
  const std::optional<NamedHook> h = ParseHookName(name);
  if (!h.has_value() || !h->layer.has_value() ||
      std::find(std::begin(kSaeHooks), std::end(kSaeHooks), h->hook) == std::end(kSaeHooks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hook \"", std::string(name),
                     "\" is none an SAE can read: blocks.{layer}.hook_resid_pre, hook_resid_mid, "
                     "hook_resid_post, hook_attn_out, hook_mlp_out or attn.hook_z"));
  }
  *hook = h->hook;
  *layer = *h->layer;
  return absl::OkStatus();
}

absl::Status CheckSaeFitsModel(const Sae& sae, const ModelConfig& c) {
  if (sae.layer >= c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("SAE ", sae.name, ": hook ", sae.hook_name,
                                                   " reads layer ", sae.layer, "; the model has ",
                                                   c.num_layers, " layers"));
  }
  const int64_t width = HookRowElements(c, sae.hook, /*num_keys=*/0);  // (residual hooks)
  if (sae.d_in != width) {
    return absl::InvalidArgumentError(absl::StrCat("SAE ", sae.name, ": d_in = ", sae.d_in,
                                                   ", but the model's ", sae.hook_name,
                                                   " rows have ", width, " values"));
  }
  return absl::OkStatus();
}

template <typename T>
std::vector<T> SaeEncode(const Sae& sae, kernels::Backend<T>& be, const T* x, int rows) {
  const int64_t din = sae.d_in, ds = sae.d_sae;
  std::vector<T> in(x, x + rows * din), pre(rows * ds);
  if (sae.apply_b_dec_to_input) {
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < din; ++j) in[i * din + j] -= static_cast<T>(sae.b_dec[j]);
  }
  be.MatMul(in.data(), rows, sae.EncView(), sae.BEncView(), pre.data());
  std::vector<T> f(rows * ds, T(0));
  std::vector<int32_t> order;
  for (int64_t i = 0; i < rows; ++i) {
    const T* p = pre.data() + i * ds;
    T* out = f.data() + i * ds;
    switch (sae.architecture) {
      case SaeArchitecture::kStandard:
        for (int64_t j = 0; j < ds; ++j) out[j] = std::max(p[j], T(0));
        break;
      case SaeArchitecture::kJumpRelu:
        for (int64_t j = 0; j < ds; ++j) {
          out[j] = p[j] > static_cast<T>(sae.threshold[j]) ? std::max(p[j], T(0)) : T(0);
        }
        break;
      case SaeArchitecture::kTopK: {
        order.resize(ds);
        std::iota(order.begin(), order.end(), 0);
        const int k = std::min<int64_t>(sae.k, ds);
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
          return p[a] > p[b] || (p[a] == p[b] && a < b);
        });
        for (int r = 0; r < k; ++r) out[order[r]] = std::max(p[order[r]], T(0));
        break;
      }
    }
  }
  return f;
}

template <typename T>
std::vector<T> SaeDecode(const Sae& sae, kernels::Backend<T>& be, const T* f, int rows) {
  std::vector<T> x(int64_t{rows} * sae.d_in);
  be.MatMul(f, rows, sae.DecView(), sae.BDecView(), x.data());
  return x;
}

#define KVLENS_INSTANTIATE_SAE(T)                                                        \
  template std::vector<T> SaeEncode<T>(const Sae&, kernels::Backend<T>&, const T*, int); \
  template std::vector<T> SaeDecode<T>(const Sae&, kernels::Backend<T>&, const T*, int);

KVLENS_INSTANTIATE_SAE(float)
KVLENS_INSTANTIATE_SAE(double)
#undef KVLENS_INSTANTIATE_SAE

}  // namespace kvlens::interpret
