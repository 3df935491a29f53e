#include "kernels/memory.h"

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace kvlens::kernels {
namespace {

constexpr std::align_val_t kAlignment{64};

class HostMemoryImpl final : public Memory {
 public:
  std::string_view name() const override { return "host"; }
  bool host_accessible() const override { return true; }
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    void* p = ::operator new(bytes, kAlignment, std::nothrow);
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("host allocation of ", bytes, " bytes failed"));
    }
    return p;
  }
  void Free(void* p) override {
    if (p != nullptr) ::operator delete(p, kAlignment);
  }
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    if (bytes != 0) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Memset(void* dst, int byte, size_t bytes) override {
    if (bytes != 0) std::memset(dst, byte, bytes);
    return absl::OkStatus();
  }
};

}  // namespace

Memory& HostMemory() {
  static HostMemoryImpl* const memory = new HostMemoryImpl;  // never destroyed
  return *memory;
}

}  // namespace kvlens::kernels
