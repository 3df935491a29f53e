#include "kernels/backend_factory.h"

#include <cstdint>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#ifdef KVLENS_HAVE_CUDA
#include "kernels/cuda/attention_tuner.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvlens::kernels {

std::string DeviceSpec::ToString() const {
  return kind == Kind::kCpu ? std::string("cpu") : absl::StrCat("cuda:", index);
}

absl::StatusOr<DeviceSpec> ParseDevice(std::string_view text) {
  const auto bad = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("device \"", std::string(text), "\" is not one of cpu, cuda, cuda:N"));
  };
  if (text == "cpu") return DeviceSpec{DeviceSpec::Kind::kCpu, 0};
  if (text == "cuda") return DeviceSpec{DeviceSpec::Kind::kCuda, 0};
  constexpr std::string_view kCudaPrefix = "cuda:";
  if (text.substr(0, kCudaPrefix.size()) != kCudaPrefix) return bad();
  const std::string digits(text.substr(kCudaPrefix.size()));
  int32_t index = 0;
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(digits, &index) || index > 1023) {
    return bad();
  }
  return DeviceSpec{DeviceSpec::Kind::kCuda, index};
}

bool HasCudaSupport() {
#ifdef KVLENS_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

absl::StatusOr<CreatedBackend> CreateBackend(const DeviceSpec& device, int cpu_threads,
                                             [[maybe_unused]] Backend<float>* share_weights_with) {
  CreatedBackend out;
  if (device.kind == DeviceSpec::Kind::kCpu) {
    if (device.attention_tensor_cores) {
      return absl::InvalidArgumentError(
          "tensor-core attention is a CUDA option: the CPU backend's attention is fp32");
    }
    if (device.programmatic_launches) {
      return absl::InvalidArgumentError(
          "programmatic launches are a CUDA option: the CPU backend launches no kernels");
    }
    auto cpu = std::make_unique<CpuBackend>(cpu_threads);
    cpu->SetInt8Activations(device.int8_activations);
    out.description =
        device.int8_activations
            ? absl::StrCat(std::string(cpu->name()), " (int8 activations for quantised weights)")
            : std::string(cpu->name());
    out.backend = std::move(cpu);
    return out;
  }
  if (device.int8_activations) {
    return absl::InvalidArgumentError(
        "int8 activations are a CPU option: the CUDA backend multiplies f16 copies of quantised "
        "weights");
  }
#ifdef KVLENS_HAVE_CUDA
  auto cuda = cuda::CudaBackend::Create(device.index);
  if (!cuda.ok()) return cuda.status();
  (*cuda)->SetCudaGraphs(device.cuda_graphs);
  (*cuda)->SetSplitKvTensorCores(device.attention_tensor_cores);
  // Process-wide: turned on, never off here (another backend of the process may be using it).
  if (device.programmatic_launches) (*cuda)->SetProgrammaticLaunches(true);
  if (auto* peer = dynamic_cast<cuda::CudaBackend*>(share_weights_with);
      peer != nullptr && peer->device() == device.index) {
    if (absl::Status s = (*cuda)->ShareWeightsWith(*peer); !s.ok()) return s;
    // And its attention kernels: --attention-tune's choice for serving, on the same GPU.
    if (absl::Status s = (*cuda)->SetAttentionKernels(peer->attention_kernels()); !s.ok()) {
      return s;
    }
  }
  out.description =
      absl::StrCat(device.ToString(), " (", (*cuda)->device_name(),
                   device.attention_tensor_cores ? ", decode attention on tensor cores" : "",
                   device.programmatic_launches ? ", programmatic launches" : "", ")");
  out.backend = *std::move(cuda);
  return out;
#else
  return absl::FailedPreconditionError(
      "this build has no CUDA support (configure with -DKVLENS_CUDA=ON)");
#endif
}

absl::StatusOr<AttentionTuneReport> TuneAttention([[maybe_unused]] Backend<float>& backend,
                                                  const AttentionTuneShape& shape) {
  if (absl::Status s = shape.Validate(); !s.ok()) return s;
#ifdef KVLENS_HAVE_CUDA
  if (auto* cuda = dynamic_cast<cuda::CudaBackend*>(&backend); cuda != nullptr) {
    return cuda::TuneAttention(*cuda, shape);
  }
#endif
  return absl::FailedPreconditionError(
      "attention tuning is a CUDA option: the CPU backend has one attention kernel");
}

}  // namespace kvlens::kernels
