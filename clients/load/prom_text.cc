#include "clients/load/prom_text.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvlens::load {
namespace {

bool IsNameStart(char c) {
  return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':';
}
bool IsNameChar(char c) { return IsNameStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// A cursor over one line; every Parse* returns false on malformed input.
class LineParser {
 public:
  explicit LineParser(std::string_view line) : s_(line) {}

  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t')) ++i_;
  }
  bool AtEnd() const { return i_ >= s_.size(); }
  bool Consume(char c) {
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }

  bool ParseName(std::string& out) {
    if (AtEnd() || !IsNameStart(s_[i_])) return false;
    const size_t start = i_;
    while (i_ < s_.size() && IsNameChar(s_[i_])) ++i_;
    out.assign(s_.substr(start, i_ - start));
    return true;
  }

  // "…" with the format's escapes \\, \" and \n.
  bool ParseQuoted(std::string& out) {
    if (!Consume('"')) return false;
    out.clear();
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return true;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (i_ >= s_.size()) return false;
      const char e = s_[i_++];
      out.push_back(e == 'n' ? '\n' : e);  // \\ and \" stand for themselves
    }
    return false;  // unterminated
  }

  // {name="value",…} with an optional trailing comma.
  bool ParseLabels(Labels& labels) {
    if (!Consume('{')) return true;  // no label set
    SkipSpace();
    while (!Consume('}')) {
      std::string name, value;
      if (!ParseName(name)) return false;
      SkipSpace();
      if (!Consume('=')) return false;
      SkipSpace();
      if (!ParseQuoted(value)) return false;
      labels[name] = value;
      SkipSpace();
      if (!Consume(',')) {
        SkipSpace();
        if (!Consume('}')) return false;
        return true;
      }
      SkipSpace();
    }
    return true;
  }

  // A float as Go and prometheus-cpp write it: digits, exponents, NaN, +Inf, -Inf.
  bool ParseValue(double& out) {
    const size_t start = i_;
    while (i_ < s_.size() && s_[i_] != ' ' && s_[i_] != '\t') ++i_;
    const std::string token(s_.substr(start, i_ - start));
    if (token.empty()) return false;
    char* end = nullptr;
    out = std::strtod(token.c_str(), &end);
    return end == token.c_str() + token.size();
  }

 private:
  std::string_view s_;
  size_t i_ = 0;
};

bool Matches(const Labels& labels, const Labels& match) {
  for (const auto& [k, v] : match) {
    auto it = labels.find(k);
    if (it == labels.end() || it->second != v) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::vector<PromSample>> ParsePromText(std::string_view text) {
  std::vector<PromSample> samples;
  int line_no = 0;
  while (!text.empty()) {
    const size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    LineParser p(line);
    p.SkipSpace();
    if (p.AtEnd() || p.Consume('#')) continue;  // blank, or HELP/TYPE/comment
    PromSample sample;
    double timestamp = 0;
    bool ok = p.ParseName(sample.name) && p.ParseLabels(sample.labels);
    if (ok) {
      p.SkipSpace();
      ok = p.ParseValue(sample.value);
    }
    if (ok) {
      p.SkipSpace();
      ok = p.AtEnd() || (p.ParseValue(timestamp) && (p.SkipSpace(), p.AtEnd()));
    }
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("metrics line ", line_no,
                                                     " is not in the Prometheus text format: '",
                                                     std::string(line), "'"));
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

bool MetricSnapshot::Has(std::string_view name) const {
  for (const PromSample& s : samples_) {
    if (s.name == name) return true;
  }
  return false;
}

double MetricSnapshot::Sum(std::string_view name, const Labels& match) const {
  double sum = 0;
  for (const PromSample& s : samples_) {
    if (s.name == name && Matches(s.labels, match)) sum += s.value;
  }
  return sum;
}

std::map<std::string, double> MetricSnapshot::SumBy(std::string_view name, const std::string& label,
                                                    const Labels& match) const {
  std::map<std::string, double> out;
  for (const PromSample& s : samples_) {
    if (s.name != name || !Matches(s.labels, match)) continue;
    auto it = s.labels.find(label);
    out[it == s.labels.end() ? std::string() : it->second] += s.value;
  }
  return out;
}

}  // namespace kvlens::load
