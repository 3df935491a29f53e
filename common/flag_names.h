// absl flags are C identifiers (--metrics_port); kvlens' documented interface spells them
// with hyphens (--metrics-port). NormalizeFlagNames rewrites '-' to '_' in every
// "--name[=value]" argument's name so both spellings work. Header-only: the server and the
// client binaries share it without a library.
#ifndef KVLENS_COMMON_FLAG_NAMES_H_
#define KVLENS_COMMON_FLAG_NAMES_H_

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace kvlens {

// Returns argv rewritten into `storage` (which must outlive the result).
inline std::vector<char*> NormalizeFlagNames(int argc, char** argv,
                                             std::vector<std::string>& storage) {
  storage.assign(argv, argv + argc);
  for (size_t i = 1; i < storage.size(); ++i) {
    std::string& a = storage[i];
    if (a.rfind("--", 0) != 0) continue;
    const size_t end = std::min(a.find('='), a.size());
    std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
  }
  std::vector<char*> out;
  for (std::string& s : storage) out.push_back(s.data());
  return out;
}

}  // namespace kvlens

#endif  // KVLENS_COMMON_FLAG_NAMES_H_
