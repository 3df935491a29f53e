// Interpret.ListSaes and Interpret.SaeFeatures: the loaded SAEs (engine/interpret/sae.h)
// over a tape's hook, into their responses.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/sae.h"
#include "server/interpret_common.h"

namespace kvlens::server {
namespace {

void FillSaeInfo(const interpret::Sae& sae, v1::SaeInfo* info) {
  info->set_name(sae.name);
  info->set_hook(sae.hook_name);
  info->set_layer(sae.layer);
  info->set_architecture(std::string(interpret::SaeArchitectureName(sae.architecture)));
  info->set_d_in(sae.d_in);
  info->set_d_sae(sae.d_sae);
  info->set_k(sae.k);
  info->set_apply_b_dec_to_input(sae.apply_b_dec_to_input);
  info->set_path(sae.path);
}

// The SAE's products run on the host: the fp64 reference backend, or the worker's own
// CpuBackend for fp32 (also with --interp-device: the SAE's weights live in host memory).
template <typename T>
kernels::Backend<T>& SaeBackendOf(InterpBackends& b) {
  if constexpr (std::is_same_v<T, double>) {
    return b.f64;
  } else {
    return b.f32;
  }
}

template <typename T>
absl::Status SaeFeaturesAt(const InterpContext& ctx, const interpret::Sae& sae,
                           const SequenceSpec& seq, PositionRange rows, int top_k,
                           const std::vector<int>& feature_ids, v1::SaeFeaturesResponse* response) {
  const Model& model = ctx.model();
  const int num = static_cast<int>(seq.tokens.size());
  if (absl::Status s =
          CheckTapeBytes(WorkBytes<T>(model.config, num, num, 1, false) +
                             int64_t{2} * rows.size() * (sae.d_sae + sae.d_in) * sizeof(T),
                         num, ctx.limits, "SaeFeatures");
      !s.ok()) {
    return s;
  }
  auto tape = interpret::RunForward(model, BackendOf<T>(ctx.backends), InputOf<T>(seq));
  if (!tape.ok()) return tape.status();
  auto x = interpret::ReadHook(model, BackendOf<T>(ctx.backends), *tape, sae.hook, sae.layer,
                               rows.begin, rows.end);
  if (!x.ok()) return x.status();
  kernels::Backend<T>& be = SaeBackendOf<T>(ctx.backends);
  const std::vector<T> f = interpret::SaeEncode(sae, be, x->data(), rows.size());
  const std::vector<T> recon = interpret::SaeDecode(sae, be, f.data(), rows.size());
  const int64_t ds = sae.d_sae, din = sae.d_in;
  std::vector<int32_t> order(ds);
  for (int i = 0; i < rows.size(); ++i) {
    const T* fi = f.data() + i * ds;
    v1::SaeRow* row = response->add_rows();
    row->set_position(rows.begin + i);
    int l0 = 0;
    for (int64_t j = 0; j < ds; ++j) l0 += fi[j] != T(0) ? 1 : 0;
    row->set_l0(l0);
    std::iota(order.begin(), order.end(), 0);
    const int k = std::min(top_k, l0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return fi[a] > fi[b] || (fi[a] == fi[b] && a < b);
    });
    for (int r = 0; r < k; ++r) {
      v1::SaeFeature* feature = row->add_top();
      feature->set_index(order[r]);
      feature->set_activation(fi[order[r]]);
    }
    for (int id : feature_ids) row->add_features(fi[id]);
    double err = 0, norm = 0;
    for (int64_t j = 0; j < din; ++j) {
      const double xv = (*x)[i * din + j], d = xv - recon[i * din + j];
      err += d * d;
      norm += xv * xv;
    }
    row->set_reconstruction_mse(err / din);
    row->set_relative_error(norm > 0 ? std::sqrt(err / norm) : 0.0);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunListSaes(const InterpContext& ctx, v1::ListSaesResponse* response) {
  if (ctx.saes != nullptr) {
    for (const auto& sae : *ctx.saes) FillSaeInfo(*sae, response->add_saes());
  }
  return absl::OkStatus();
}

absl::Status RunSaeFeatures(const InterpContext& ctx, const v1::SaeFeaturesRequest& request,
                            v1::SaeFeaturesResponse* response) {
  const interpret::Sae* sae = nullptr;
  std::string names;
  const size_t loaded = ctx.saes == nullptr ? 0 : ctx.saes->size();
  for (size_t i = 0; i < loaded; ++i) {
    const interpret::Sae& s = *(*ctx.saes)[i];
    absl::StrAppend(&names, i ? ", " : "", s.name);
    if (s.name == request.sae() || (request.sae().empty() && loaded == 1)) sae = &s;
  }
  if (loaded == 0) {
    return absl::FailedPreconditionError(
        "no SAE is loaded: start kvlens-server with --sae [NAME=]PATH[@HOOK]");
  }
  if (sae == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("sae = \"", request.sae(), "\" names none of the loaded SAEs: ", names));
  }
  auto seq = Resolve(ctx, request.input(), "input", true);
  if (!seq.ok()) return seq.status();
  const int n = static_cast<int>(seq->tokens.size());
  auto rows = ToRange(request.positions(), n, "positions");
  if (!rows.ok()) return rows.status();
  const int top_k = request.top_k() == 0 ? std::min(10, sae->d_sae) : request.top_k();
  if (top_k < 1 || top_k > std::min(ctx.limits.max_top_k, sae->d_sae)) {
    return absl::InvalidArgumentError(absl::StrCat("top_k = ", request.top_k(), " must be in [1, ",
                                                   std::min(ctx.limits.max_top_k, sae->d_sae),
                                                   "]"));
  }
  if (request.feature_ids_size() > ctx.limits.max_targets) {
    return absl::InvalidArgumentError(absl::StrCat("feature_ids has ", request.feature_ids_size(),
                                                   " entries, more than the server allows (",
                                                   ctx.limits.max_targets, ")"));
  }
  std::vector<int> feature_ids;
  for (int id : request.feature_ids()) {
    if (id < 0 || id >= sae->d_sae) {
      return absl::InvalidArgumentError(
          absl::StrCat("feature_ids: ", id, " is outside [0, d_sae = ", sae->d_sae, ")"));
    }
    feature_ids.push_back(id);
  }
  const int64_t bytes =
      int64_t{rows->size()} * (16 * (top_k + static_cast<int64_t>(feature_ids.size())) + 32);
  if (absl::Status s = CheckBytes(bytes, ctx.limits, "the SAE features"); !s.ok()) return s;
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  FillSaeInfo(*sae, response->mutable_sae());
  response->mutable_token_ids()->Assign(seq->tokens.begin(), seq->tokens.end());
  return fp64 ? SaeFeaturesAt<double>(ctx, *sae, *seq, *rows, top_k, feature_ids, response)
              : SaeFeaturesAt<float>(ctx, *sae, *seq, *rows, top_k, feature_ids, response);
}

}  // namespace kvlens::server
