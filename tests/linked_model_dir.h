// A temporary model directory whose files are symlinks to a real one, plus files of the
// test's own (e.g. a generation_config.json), removed when it goes out of scope.
#ifndef KVLENS_TESTS_LINKED_MODEL_DIR_H_
#define KVLENS_TESTS_LINKED_MODEL_DIR_H_

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvlens::testing {

class LinkedModelDir {
 public:
  // Links every file of `source` except those named in `own`, then writes `own`.
  LinkedModelDir(const std::string& source, const std::map<std::string, std::string>& own) {
    namespace fs = std::filesystem;
    static std::atomic<int> counter{0};
    dir_ = absl::StrCat(fs::temp_directory_path().string(), "/kvlens_model_", getpid(), "_",
                        counter++);
    fs::create_directories(dir_);
    for (const auto& e : fs::directory_iterator(source)) {
      const std::string name = e.path().filename().string();
      if (own.count(name) == 0) fs::create_symlink(fs::absolute(e.path()), fs::path(dir_) / name);
    }
    for (const auto& [name, text] : own) std::ofstream(fs::path(dir_) / name) << text;
  }
  ~LinkedModelDir() { std::filesystem::remove_all(dir_); }
  LinkedModelDir(const LinkedModelDir&) = delete;
  LinkedModelDir& operator=(const LinkedModelDir&) = delete;

  const std::string& path() const { return dir_; }

 private:
  std::string dir_;
};

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_LINKED_MODEL_DIR_H_
