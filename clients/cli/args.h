// A small `--name value` / `--name=value` parser for kvlens-cli. Each command declares
// its flags with help text; unknown flags and malformed values are errors that name the
// flag (absl flags cannot spell the hyphenated names our interface promises).
#ifndef KVLENS_CLIENTS_CLI_ARGS_H_
#define KVLENS_CLIENTS_CLI_ARGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvlens::cli {

struct FlagSpec {
  std::string name;   // without the leading "--"
  std::string value;  // default value ("" = none); "false"/"true" for switches
  std::string help;
  bool is_switch = false;  // takes no value: present means true
};

class Args {
 public:
  // Parses argv[first …] against `specs`. "--help" sets help(). A flag's '_' reads as
  // '-' (--max_new_tokens); an unknown flag's error names the nearest one, or lists them.
  static absl::StatusOr<Args> Parse(int argc, char** argv, int first,
                                    const std::vector<FlagSpec>& specs);
  static std::string Usage(const std::string& command, const std::string& summary,
                           const std::vector<FlagSpec>& specs);

  bool help() const { return help_; }
  bool Has(const std::string& name) const { return given_.count(name) > 0; }
  std::string Str(const std::string& name) const { return values_.at(name); }
  // Every value given for `name`, in order (a flag given more than once; Str has the last).
  std::vector<std::string> All(const std::string& name) const {
    auto it = all_.find(name);
    return it == all_.end() ? std::vector<std::string>{} : it->second;
  }
  absl::StatusOr<int64_t> Int(const std::string& name, int64_t min, int64_t max) const;
  absl::StatusOr<double> Double(const std::string& name, double min, double max) const;
  bool Switch(const std::string& name) const { return values_.at(name) == "true"; }

 private:
  std::map<std::string, std::string> values_;
  std::map<std::string, bool> given_;
  std::map<std::string, std::vector<std::string>> all_;
  bool help_ = false;
};

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_ARGS_H_
