#include "engine/interpret/hook_finite_difference.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cpu/reference_backend.h"

namespace kvlens::interpret {
namespace {

constexpr Hook kFdHooks[] = {Hook::kResidPre, Hook::kResidMid, Hook::kResidPost, Hook::kAttnOut,
                             Hook::kMlpOut,   Hook::kZ,        Hook::kQ,         Hook::kK,
                             Hook::kV,        Hook::kRotQ,     Hook::kRotK,      Hook::kAttnScores,
                             Hook::kPattern,  Hook::kEmbed,    Hook::kPosEmbed};

// The site a ResidualPatch moves for resid_mid, attn_out and mlp_out (the hooks the sites
// are named after, as PatchTargetByName reads them); nullopt for the others.
std::optional<PatchSite> PatchSiteOf(Hook hook) {
  for (PatchSite site : {PatchSite::kResidMid, PatchSite::kAttnOut, PatchSite::kMlpOut}) {
    if (HookName(hook) == PatchSiteName(site)) return site;
  }
  return std::nullopt;
}

// The tape's entry that entry `e` (flat, HookShape's order) of `hook` at `layer` is, for
// the hooks that a perturbation moves (not the patched ones).
Coord CoordOf(const ModelConfig& c, Hook hook, int layer, int n, int tk, int64_t e) {
  Coord at;
  at.layer = layer;
  const int64_t dh = c.head_dim;
  auto head_vector = [&](TensorKind kind, int heads) {
    at.kind = kind;
    at.row = static_cast<int>(e / (heads * dh));
    at.head = static_cast<int>(e / dh % heads);
    at.col = static_cast<int>(e % dh);
  };
  switch (hook) {
    case Hook::kZ:
      head_vector(TensorKind::kAttnOut, c.num_heads);
      break;
    case Hook::kQ:
    case Hook::kRotQ:
      head_vector(TensorKind::kQ, c.num_heads);
      break;
    case Hook::kK:
    case Hook::kRotK:
      head_vector(TensorKind::kK, c.num_kv_heads);
      break;
    case Hook::kV:
      head_vector(TensorKind::kV, c.num_kv_heads);
      break;
    case Hook::kAttnScores:
    case Hook::kPattern:
      at.kind = hook == Hook::kPattern ? TensorKind::kProbs : TensorKind::kScores;
      at.head = static_cast<int>(e / (int64_t{n} * tk));
      at.row = static_cast<int>(e / tk % n);
      at.col = static_cast<int>(e % tk);
      break;
    default:  // the residual stream: resid_pre (l), resid_post (l + 1), embed, pos_embed (0)
      at.kind = TensorKind::kResidual;
      at.layer = hook == Hook::kResidPost                          ? layer + 1
                 : hook == Hook::kEmbed || hook == Hook::kPosEmbed ? 0
                                                                   : layer;
      at.row = static_cast<int>(e / c.dim);
      at.col = static_cast<int>(e % c.dim);
      break;
  }
  return at;
}

}  // namespace

bool HookHasFiniteDifference(Hook hook) {
  return std::find(std::begin(kFdHooks), std::end(kFdHooks), hook) != std::end(kFdHooks);
}

absl::StatusOr<FdHookReport> CheckHookGradientByFiniteDifferences(
    const Model& model, const SequenceInput<double>& input, const Objective& objective, Hook hook,
    int layer, absl::Span<const double> gradient, const FdOptions& options) {
  const ModelConfig& c = model.config;
  const int n = static_cast<int>(input.tokens.size()), tk = input.offset + n;
  const std::string name(HookName(hook));
  if (!HookHasFiniteDifference(hook)) {
    std::vector<std::string> names;
    for (Hook h : kFdHooks) names.emplace_back(HookName(h));
    return absl::InvalidArgumentError(
        absl::StrCat("hook ", name, " has no finite-difference check (no edit moves one of its ",
                     "entries alone); those that have: ", absl::StrJoin(names, ", ")));
  }
  if (absl::Status s = CheckModelHasHook(c, hook); !s.ok()) return s;
  if (HookIsPerLayer(hook) && (layer < 0 || layer >= c.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " of hook ", name, " is outside [0, ", c.num_layers, ")"));
  }
  const int rows = HookRowsAreKeys(hook) ? tk : n;
  int64_t size = 1;
  for (int64_t d : HookShape(c, hook, rows, tk)) size *= d;
  if (static_cast<int64_t>(gradient.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat("the gradient of hook ", name, " has ",
                                                   gradient.size(), " values; its shape ", "holds ",
                                                   size));
  }
  if (absl::Status s = ValidateObjective(objective, c, n); !s.ok()) return s;
  kernels::ReferenceBackend be;
  FdHookReport report;
  report.hook = hook;
  report.layer = layer;
  // The clean rows a patched hook's steps start from.
  const std::optional<PatchSite> site = PatchSiteOf(hook);
  std::optional<Tape<double>> clean;
  if (site.has_value()) {
    auto tape = RunForward(model, be, input);
    if (!tape.ok()) return tape.status();
    ++report.num_forwards;
    clean = std::move(*tape);
  }
  double g_max = 0.0;
  for (double v : gradient) g_max = std::max(g_max, std::abs(v));
  const double floor = 1e-3 * g_max;
  const bool scores = hook == Hook::kAttnScores || hook == Hook::kPattern;
  std::mt19937_64 rng(options.seed);
  auto pick = [&](int64_t hi) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(hi)); };
  for (int s = 0; s < options.samples_per_tensor; ++s) {
    FdHookSample sample;
    if (scores) {  // a visible (row, key) of a random head
      const int64_t head = pick(c.num_heads), row = pick(n);
      std::vector<int> visible;
      for (int j = 0; j < tk; ++j) {
        if (KeyVisible(input, static_cast<int>(row), j, c.WindowOf(layer))) visible.push_back(j);
      }
      sample.index = (head * n + row) * tk + visible[pick(static_cast<int64_t>(visible.size()))];
    } else {
      sample.index = pick(size);
    }
    std::vector<double> clean_row;
    int row = 0, col = 0;
    if (site.has_value()) {
      row = static_cast<int>(sample.index / c.dim);
      col = static_cast<int>(sample.index % c.dim);
      auto r = ReadHook(model, be, *clean, hook, layer, row, row + 1);
      if (!r.ok()) return r.status();
      clean_row = std::move(*r);
    }
    const Coord at = CoordOf(c, hook, layer, n, tk, sample.index);
    const std::vector<std::pair<Coord, double>> dir =
        hook == Hook::kQ || hook == Hook::kK ? RopeDirection(model, input, be, at)
                                             : std::vector<std::pair<Coord, double>>{{at, 1.0}};
    auto j_at = [&](double m) -> absl::StatusOr<double> {
      Edits e;
      if (site.has_value()) {
        std::vector<double> value = clean_row;
        value[col] += m * options.step;
        e.patches.push_back({layer, row, std::move(value), *site});
      } else {
        for (const auto& [to, u] : dir) e.perturbations.push_back({to, m * options.step * u});
      }
      return ObjectiveUnder(model, be, input, objective, e, &report.num_forwards);
    };
    auto st = CentredDifference(options, j_at);
    if (!st.ok()) return st.status();
    sample.fd = st->fd;
    sample.gradient = gradient[sample.index];
    report.max_abs_err = std::max(report.max_abs_err, std::abs(sample.gradient - sample.fd));
    report.max_rel_err =
        std::max(report.max_rel_err, FdRelativeError(sample.gradient, *st, floor, options));
    report.samples.push_back(sample);
  }
  return report;
}

}  // namespace kvlens::interpret
