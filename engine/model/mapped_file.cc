#include "engine/model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvlens {

absl::StatusOr<std::shared_ptr<MappedFile>> MappedFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("file not found: ", path));
    return absl::InvalidArgumentError(absl::StrCat("cannot open ", path, ": ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("not a regular file: ", path));
  }
  if (st.st_size == 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("file is empty: ", path));
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap failed for ", path, ": ", std::strerror(err)));
  }
  return std::shared_ptr<MappedFile>(
      new MappedFile(path, static_cast<const uint8_t*>(p), static_cast<size_t>(st.st_size)));
}

MappedFile::~MappedFile() { ::munmap(const_cast<uint8_t*>(data_), size_); }

}  // namespace kvlens
