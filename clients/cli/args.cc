#include "clients/cli/args.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvlens::cli {
namespace {

// Levenshtein distance (flag names are short).
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// "unknown flag --NAME" and the likeliest meant flag (within a third of the name's length
// in edits, at least 2), or else the command's flags.
std::string UnknownFlag(const std::string& name, const std::vector<FlagSpec>& specs) {
  const FlagSpec* nearest = nullptr;
  size_t best = std::max<size_t>(2, name.size() / 3) + 1;
  for (const FlagSpec& s : specs) {
    const size_t d = EditDistance(name, s.name);
    if (d < best) {
      best = d;
      nearest = &s;
    }
  }
  if (nearest != nullptr) {
    return absl::StrCat("unknown flag --", name, "; did you mean --", nearest->name, "?");
  }
  std::vector<std::string> names;
  for (const FlagSpec& s : specs) names.push_back("--" + s.name);
  return absl::StrCat("unknown flag --", name, "; this command takes ", absl::StrJoin(names, " "),
                      " (see --help)");
}

}  // namespace

absl::StatusOr<Args> Args::Parse(int argc, char** argv, int first,
                                 const std::vector<FlagSpec>& specs) {
  Args args;
  std::map<std::string, const FlagSpec*> by_name;
  for (const FlagSpec& s : specs) {
    by_name[s.name] = &s;
    args.values_[s.name] = s.is_switch ? "false" : s.value;
  }
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      args.help_ = true;
      continue;
    }
    if (a.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
    a = a.substr(2);
    std::string value;
    bool has_value = false;
    if (const size_t eq = a.find('='); eq != std::string::npos) {
      value = a.substr(eq + 1);
      a = a.substr(0, eq);
      has_value = true;
    }
    std::replace(a.begin(), a.end(), '_', '-');  // --max_new_tokens as --max-new-tokens
    auto it = by_name.find(a);
    if (it == by_name.end()) return absl::InvalidArgumentError(UnknownFlag(a, specs));
    if (it->second->is_switch) {
      if (has_value && value != "true" && value != "false") {
        return absl::InvalidArgumentError(absl::StrCat("--", a, " takes true or false"));
      }
      args.values_[a] = has_value ? value : "true";
    } else {
      if (!has_value) {
        if (i + 1 >= argc)
          return absl::InvalidArgumentError(absl::StrCat("--", a, " needs a value"));
        value = argv[++i];
      }
      args.values_[a] = value;
      args.all_[a].push_back(value);
    }
    args.given_[a] = true;
  }
  return args;
}

std::string Args::Usage(const std::string& command, const std::string& summary,
                        const std::vector<FlagSpec>& specs) {
  std::string out =
      absl::StrCat("usage: kvlens-cli ", command, " [flags]\n\n", summary, "\n\nflags:\n");
  for (const FlagSpec& s : specs) {
    absl::StrAppend(&out, "  --", s.name, s.is_switch ? "" : " VALUE", "\n      ", s.help);
    if (!s.is_switch && !s.value.empty()) absl::StrAppend(&out, " (default: ", s.value, ")");
    absl::StrAppend(&out, "\n");
  }
  return out;
}

absl::StatusOr<int64_t> Args::Int(const std::string& name, int64_t min, int64_t max) const {
  int64_t v = 0;
  if (!absl::SimpleAtoi(values_.at(name), &v) || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", name, " = '", values_.at(name), "' must be an integer in [", min, ", ", max, "]"));
  }
  return v;
}

absl::StatusOr<double> Args::Double(const std::string& name, double min, double max) const {
  double v = 0;
  if (!absl::SimpleAtod(values_.at(name), &v) || !(v >= min && v <= max)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " = '", values_.at(name),
                                                   "' must be a number in [", min, ", ", max, "]"));
  }
  return v;
}

}  // namespace kvlens::cli
