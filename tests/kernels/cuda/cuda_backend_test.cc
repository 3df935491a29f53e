// CudaBackend against the double ReferenceBackend: the parity table of cuda_parity.h, the
// error contract of Attention, and creation without a device. Suites are named
// CudaBackend* so that ctest labels them `gpu` (kernels/cuda/CMakeLists.txt); without a
// device they skip with the reason.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <cuda_runtime_api.h>

#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/reference_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

// "" when a device is usable, else why not.
std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e);
  }
  if (count == 0) return "no CUDA device present";
  return "";
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string reason = NoDeviceReason(); !reason.empty()) GTEST_SKIP() << reason;
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(0);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  std::unique_ptr<CudaBackend> backend_;
};

TEST(CudaBackendCreateTest, FailsCleanlyWithoutADevice) {
  if (NoDeviceReason().empty()) GTEST_SKIP() << "a CUDA device is present";
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(0);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
}

TEST_F(CudaBackendTest, RejectsAMissingDevice) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(1 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
}

TEST_F(CudaBackendTest, ParityTableWithinTwiceTheNaiveLowPrecisionError) {
  const std::vector<parity::ParityResult> results = parity::RunParitySuite(*backend_);
  EXPECT_EQ(results.size(), 39u);  // one per case; maps cases add probs (and scores)
  for (const parity::ParityResult& r : results) {
    std::cerr << "[ parity   ] " << r.name << ": error " << r.err << ", tolerance " << r.tol
              << "\n";
    EXPECT_TRUE(r.status.ok()) << r.name << ": " << r.status;
    EXPECT_LE(r.err, r.tol) << r.name << ": error " << r.err << ", naive error " << r.naive_err;
  }
}

// A row whose document has no key at or before its position: the same INVALID_ARGUMENT
// as the CPU reference, naming the row, and the backend stays usable.
TEST_F(CudaBackendTest, RowWithNoVisibleKeyIsInvalidArgumentNamingTheRow) {
  const int tq = 3, tk = 3, dh = 64;
  std::vector<double> zeros_d(static_cast<size_t>(tk) * dh, 0.5);
  std::vector<double> out_d(static_cast<size_t>(tq) * dh);
  const std::vector<int32_t> q_doc = {0, 0, 1}, k_doc = {0, 0, 0};
  AttentionArgs<double> ra;
  ra.q = zeros_d.data();
  ra.q_stride = dh;
  ra.num_queries = tq;
  ra.num_keys = tk;
  ra.num_heads = ra.num_kv_heads = 1;
  ra.head_dim = dh;
  ra.scale = 0.125;
  ra.q_doc_ids = q_doc.data();
  ra.k_doc_ids = k_doc.data();
  ra.kv = KvSource<double>{zeros_d.data(), zeros_d.data(), dh, nullptr, 0};
  ra.out = out_d.data();
  ra.out_stride = dh;
  const absl::Status want = ReferenceBackend().Attention(ra);
  ASSERT_EQ(want.code(), absl::StatusCode::kInvalidArgument);

  auto buf = parity::ToDevice(std::vector<double>(static_cast<size_t>(tk) * dh, 0.5));
  ASSERT_TRUE(buf.ok()) << buf.status();
  AttentionArgs<float> a;
  a.q = buf->as<float>();
  a.q_stride = dh;
  a.num_queries = tq;
  a.num_keys = tk;
  a.num_heads = a.num_kv_heads = 1;
  a.head_dim = dh;
  a.scale = 0.125;
  a.q_doc_ids = q_doc.data();
  a.k_doc_ids = k_doc.data();
  a.kv = KvSource<float>{buf->as<float>(), buf->as<float>(), dh, nullptr, 0};
  a.out = buf->as<float>();
  a.out_stride = dh;
  const absl::Status got = backend_->Attention(a);
  EXPECT_EQ(got, want);
  EXPECT_NE(std::string(got.message()).find("row 2"), std::string::npos) << got;
  EXPECT_TRUE(backend_->Synchronize().ok());
}

TEST_F(CudaBackendTest, NegativeBlockIdIsInvalidArgumentLikeTheReference) {
  const int dh = 64;
  auto buf = parity::ToDevice(std::vector<double>(64 * dh, 0.5));
  ASSERT_TRUE(buf.ok()) << buf.status();
  const std::vector<int32_t> table = {1, -1};
  AttentionArgs<float> a;
  a.q = buf->as<float>();
  a.q_stride = dh;
  a.num_queries = 1;
  a.num_keys = 20;
  a.query_offset = 19;
  a.num_heads = a.num_kv_heads = 1;
  a.head_dim = dh;
  a.scale = 0.125;
  a.kv = KvSource<float>{buf->as<float>(), buf->as<float>(), dh, table.data(), 16};
  a.out = buf->as<float>();
  a.out_stride = dh;
  const absl::Status got = backend_->Attention(a);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument) << got;
  EXPECT_NE(std::string(got.message()).find("kv.block_table"), std::string::npos) << got;
  EXPECT_TRUE(backend_->status().ok());
}

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaBackendTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA
