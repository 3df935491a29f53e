// A parser for the Prometheus text exposition format (version 0.0.4), enough to read a
// kvlens-server's /metrics: `name{label="value",…} value [timestamp]` lines, with # HELP /
// # TYPE comments ignored. Histograms arrive as their _bucket/_sum/_count series.
#ifndef KVLENS_CLIENTS_LOAD_PROM_TEXT_H_
#define KVLENS_CLIENTS_LOAD_PROM_TEXT_H_

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvlens::load {

using Labels = std::map<std::string, std::string>;

struct PromSample {
  std::string name;
  Labels labels;
  double value = 0;  // NaN and ±Inf as written
};

// Every sample of `text`; INVALID_ARGUMENT naming the line on a malformed one.
absl::StatusOr<std::vector<PromSample>> ParsePromText(std::string_view text);

// One scrape, queryable by metric name and label subset.
class MetricSnapshot {
 public:
  MetricSnapshot() = default;
  explicit MetricSnapshot(std::vector<PromSample> samples) : samples_(std::move(samples)) {}

  bool empty() const { return samples_.empty(); }
  // Whether any series of `name` exists.
  bool Has(std::string_view name) const;
  // Sum over the series of `name` whose labels include every pair of `match` (0 if none).
  double Sum(std::string_view name, const Labels& match = {}) const;
  // `name`'s series (restricted to `match`) summed by the value of `label`.
  std::map<std::string, double> SumBy(std::string_view name, const std::string& label,
                                      const Labels& match = {}) const;

 private:
  std::vector<PromSample> samples_;
};

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_PROM_TEXT_H_
