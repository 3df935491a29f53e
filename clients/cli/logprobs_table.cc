#include "clients/cli/logprobs_table.h"

#include <cmath>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvlens::cli {

void PrintLogprobsTable(std::ostream& out, absl::Span<const ScoredToken> scored, int first_position,
                        std::string_view what, const std::function<std::string(int32_t)>& piece) {
  absl::flat_hash_map<int32_t, std::string> pieces;  // each token's spelling, asked once
  auto spelled = [&](int32_t token) -> const std::string& {
    auto [it, fresh] = pieces.try_emplace(token);
    if (fresh) it->second = absl::StrCat("\"", absl::CEscape(piece(token)), "\"");
    return it->second;
  };
  double sum = 0;
  out << "position\ttoken\tpiece\tlogprob\ttop (piece logprob)\n";
  for (size_t i = 0; i < scored.size(); ++i) {
    const ScoredToken& s = scored[i];
    sum += s.logprob;
    out << absl::StrFormat("%d\t%d\t%s\t%.6f\t", first_position + static_cast<int>(i), s.token,
                           spelled(s.token), s.logprob);
    for (size_t k = 0; k < s.top.size(); ++k) {
      out << absl::StrFormat("%s%s %.6f", k > 0 ? "  " : "", spelled(s.top[k].first),
                             s.top[k].second);
    }
    out << "\n";
  }
  out << absl::StrFormat("%s: %d tokens scored, sum %.6f, perplexity %.4f\n", what, scored.size(),
                         sum, scored.empty() ? 1.0 : std::exp(-sum / scored.size()));
}

}  // namespace kvlens::cli
