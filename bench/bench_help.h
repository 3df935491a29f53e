// --help for the bench programs: their arguments are positional numbers or a few flags,
// and "--help" must print the usage rather than run a benchmark on a misread argument.
#ifndef KVLENS_BENCH_BENCH_HELP_H_
#define KVLENS_BENCH_BENCH_HELP_H_

#include <cstdio>
#include <cstring>

namespace kvlens::bench {

// True (after printing `usage` to stdout) when any argument is -h or --help.
inline bool PrintedHelp(int argc, char** argv, const char* usage) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(usage, stdout);
      return true;
    }
  }
  return false;
}

}  // namespace kvlens::bench

#endif  // KVLENS_BENCH_BENCH_HELP_H_
