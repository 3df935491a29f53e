// The parity table's measure (cuda_parity.h): results, the tolerance rule, and moving
// values to and from the device.
//
// Tolerance (FlashAttention's rule): the GPU's max error against the fp64 reference must be
// at most twice the max error of a naive run on the host at the precision the GPU path
// uses (fp32 arithmetic; inputs rounded to f16/bf16 where the GPU rounds them), plus a
// floor of 8 fp32 ulps of the largest reference value for ops whose naive run is exact.
// Caches are NaN-filled outside the sequence's rows and block tables are shuffled, so a
// kernel that reads a slot it should not fails.
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_UTIL_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_UTIL_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/cpu/reference_backward.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device_buffer.h"
#include "tests/kernels/kernel_test_util.h"

namespace kvlens::kernels::cuda::parity {

using kernels::testing::OwnedWeight;

struct ParityResult {
  std::string name;
  absl::Status status;     // a failed CUDA call or a backend error
  double err = 0.0;        // max |gpu − reference|
  double naive_err = 0.0;  // max |naive − reference|
  double tol = 0.0;
  bool pass() const { return status.ok() && err <= tol; }
};

inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
inline constexpr double kInf = std::numeric_limits<double>::infinity();

// Max |a − ref|; a NaN or infinity where the reference has a different value is infinite.
inline double MaxErr(const std::vector<double>& a, const std::vector<double>& ref) {
  if (a.size() != ref.size()) return kInf;
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(ref[i]) || std::isnan(a[i])) {
      if (std::isnan(ref[i]) != std::isnan(a[i])) return kInf;
      continue;
    }
    if (std::isinf(ref[i]) || std::isinf(a[i])) {
      if (a[i] != ref[i]) return kInf;
      continue;
    }
    m = std::max(m, std::abs(a[i] - ref[i]));
  }
  return m;
}

inline double MaxFinite(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

inline ParityResult Judge(std::string name, const std::vector<double>& gpu,
                          const std::vector<double>& naive, const std::vector<double>& ref) {
  ParityResult r;
  r.name = std::move(name);
  r.err = MaxErr(gpu, ref);
  r.naive_err = MaxErr(naive, ref);
  r.tol = 2.0 * r.naive_err + 8.0 * FLT_EPSILON * MaxFinite(ref);
  return r;
}

inline ParityResult Failed(std::string name, absl::Status s) {
  ParityResult r;
  r.name = std::move(name);
  r.status = std::move(s);
  r.err = kInf;
  return r;
}

// Rounds as the GPU's tensor-core inputs are rounded.
inline double RoundTo(DType t, double x) {
  if (DTypeIsBlockQuantized(t)) return F16ToF32(F32ToF16(static_cast<float>(x)));  // as f16
  switch (t) {
    case DType::kF16:
      return F16ToF32(F32ToF16(static_cast<float>(x)));
    case DType::kBF16:
      return BF16ToF32(F32ToBF16(static_cast<float>(x)));
    default:
      return static_cast<float>(x);
  }
}

inline std::vector<float> ToFloat(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// cudaMemcpy to the device, waited for: from pageable memory it returns once the bytes
// are staged, their write still running on the legacy stream, which the backend's
// non-blocking stream does not wait for.
inline absl::Status CopyToDeviceAndWait(void* dst, const void* src, size_t bytes) {
  KVLENS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  KVLENS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  return absl::OkStatus();
}

inline absl::StatusOr<DeviceBuffer> ToDevice(const std::vector<double>& h) {
  const std::vector<float> f = ToFloat(h);
  DeviceBuffer b;
  if (absl::Status s = b.Reserve(std::max<size_t>(f.size(), 1) * sizeof(float)); !s.ok()) return s;
  if (absl::Status s = CopyToDeviceAndWait(b.get(), f.data(), f.size() * sizeof(float)); !s.ok()) {
    return s;
  }
  return b;
}

inline absl::StatusOr<std::vector<double>> FromDevice(CudaBackend& backend, const DeviceBuffer& b,
                                                      size_t n) {
  if (absl::Status s = backend.Synchronize(); !s.ok()) return s;
  std::vector<float> f(n);
  KVLENS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(f.data(), b.get(), n * sizeof(float), cudaMemcpyDeviceToHost));
  return std::vector<double>(f.begin(), f.end());
}

// A bf16 KV cache on the device: each value rounded to nearest-even bf16 (NaN stays NaN).
inline absl::StatusOr<DeviceBuffer> ToDeviceBf16(const std::vector<double>& h) {
  std::vector<uint16_t> bits(h.size());
  for (size_t i = 0; i < h.size(); ++i) bits[i] = F32ToBF16(static_cast<float>(h[i]));
  DeviceBuffer b;
  if (absl::Status s = b.Reserve(std::max<size_t>(bits.size(), 1) * sizeof(uint16_t)); !s.ok()) {
    return s;
  }
  if (absl::Status s = CopyToDeviceAndWait(b.get(), bits.data(), bits.size() * sizeof(uint16_t));
      !s.ok()) {
    return s;
  }
  return b;
}

// n bf16 values of a device buffer, widened.
inline absl::StatusOr<std::vector<double>> FromDeviceBf16(CudaBackend& backend,
                                                          const DeviceBuffer& b, size_t n) {
  if (absl::Status s = backend.Synchronize(); !s.ok()) return s;
  std::vector<uint16_t> bits(n);
  KVLENS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(bits.data(), b.get(), n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = BF16ToF32(bits[i]);
  return out;
}

}  // namespace kvlens::kernels::cuda::parity

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_PARITY_UTIL_H_
