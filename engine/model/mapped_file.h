// A read-only memory mapping of a whole file. Weights stay in the page cache and are
// shared by every process serving the same file.
#ifndef KVLENS_ENGINE_MODEL_MAPPED_FILE_H_
#define KVLENS_ENGINE_MODEL_MAPPED_FILE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvlens {

class MappedFile {
 public:
  // NOT_FOUND when the file does not exist; INVALID_ARGUMENT for a directory or an empty file.
  static absl::StatusOr<std::shared_ptr<MappedFile>> Open(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  std::string path_;
  const uint8_t* data_;
  size_t size_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_MAPPED_FILE_H_
