// CudaBackend: creation, weights and index uploads, the step hooks (CUDA graphs), and every
// op but the matrix products (cuda_backend_products.cc) and attention
// (cuda_backend_attention.cc).
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"

namespace kvlens::kernels::cuda {
namespace {

constexpr size_t kIndexRingBytes = size_t{1} << 20;
// Recent uploads compared against a new one: a layer's ops (embedding ids, RoPE positions
// twice, cache rows, the attention call's tables) with room to spare.
constexpr size_t kIndexReuse = 8;
constexpr size_t kIndexAlign = 256;

size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The launches of the backend that are not kernels of ops.h, matvec.h or attention.h, in
// the launcher form StepGraph::Run takes: arguments, then the stream.
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
                    "cudaMemcpyAsync", __FILE__, __LINE__);
}

absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                    "cudaMemcpyAsync", __FILE__, __LINE__);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky runtime error
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: cudaGetDeviceCount failed: ", cudaGetErrorName(e),
                     " (", cudaGetErrorString(e), ")"));
  }
  if (count == 0) return absl::FailedPreconditionError("no CUDA device present");
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", device, " does not exist (", count, " present)"));
  }
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  int num_sms = 0;
  KVLENS_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  cudaStream_t stream = nullptr;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cublasHandle_t cublas = nullptr;
  if (absl::Status s = CublasStatus(cublasCreate(&cublas), "cublasCreate", __FILE__, __LINE__);
      !s.ok()) {
    cudaStreamDestroy(stream);
    return s;
  }
  std::unique_ptr<CudaBackend> b(new CudaBackend(device, num_sms, stream, cublas));
  KVLENS_CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas, stream));
  // Plain fp32 GEMMs stay fp32 (no TF32); f16/bf16 inputs use the tensor cores anyway.
  KVLENS_CUBLAS_RETURN_IF_ERROR(cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH));
  if (absl::Status s = b->index_host_.Reserve(kIndexRingBytes); !s.ok()) return s;
  if (absl::Status s = b->index_device_.Reserve(kIndexRingBytes); !s.ok()) return s;
  return b;
}

CudaBackend::CudaBackend(int device, int num_sms, cudaStream_t stream, cublasContext* cublas)
    : device_(device),
      num_sms_(num_sms),
      name_(absl::StrCat("cuda:", device)),
      stream_(stream),
      memory_(device, stream),
      cublas_(cublas) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    device_name_ = prop.name;
    l2_bytes_ = prop.l2CacheSize;
  } else {
    cudaGetLastError();  // only the name is missing; clear the error
  }
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cublasDestroy(cublas_);
  cudaStreamDestroy(stream_);
}

bool CudaBackend::Ok(const absl::Status& s) {
  if (!s.ok() && status_.ok()) status_ = s;
  return status_.ok();
}

absl::Status CudaBackend::MakeCurrent() {
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  return absl::OkStatus();
}

void CudaBackend::SetCudaGraphs(bool on) {
  graphs_enabled_ = on;
  if (!on) graph_.Clear();
}

void CudaBackend::SetProgrammaticLaunches(bool on) {
  cuda::SetProgrammaticLaunches(on);
  graph_.Clear();
}

void CudaBackend::SetLaunchPrefetches(bool on) {
  cuda::SetLaunchPrefetches(on);
  graph_.Clear();
}

int CudaBackend::PaddedDecodeRows(int n) const {
  if (!graphs_enabled_ || n <= 2 || n > 512) return n;
  return n <= 4 ? 4 : (n + 7) / 8 * 8;
}

void CudaBackend::BeginStep() {
  graph_.Drop();
  if (!graphs_enabled_ || !status_.ok()) return;
  // The ring restarts at 0 for every step (the same offsets for the same uploads), so the
  // previous step's copies must have read it; the engine synchronizes after each step
  // anyway. Then the buffers retired during that step can go.
  if (!Ok(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", __FILE__,
                     __LINE__))) {
    return;
  }
  retired_.clear();
  retired_pinned_.clear();
  index_offset_ = 0;
  index_recent_.clear();
  recorded_stages_.clear();
  graph_.Begin();
}

absl::Status CudaBackend::EndStep(bool run) {
  if (!graph_.recording()) return status_;
  if (!run || !status_.ok()) {
    graph_.Drop();
    return status_;
  }
  // The step's staged index arrays, each ring's bytes in one copy before every kernel (in a
  // recorded step the ring starts at 0 and never wraps, so no upload overwrites another).
  KeepRecordedStage();
  for (const RecordedStage& r : recorded_stages_) {
    if (!Ok(graph_.RunFirst(stream_, &CopyToDevice, r.device, static_cast<const void*>(r.host),
                            r.bytes))) {
      graph_.Drop();
      return status_;
    }
    ++index_stats_.copies;
    index_stats_.bytes_copied += static_cast<int64_t>(r.bytes);
  }
  recorded_stages_.clear();
  Ok(graph_.End(stream_, &memory_.stream_mutex()));
  return status_;
}

void CudaBackend::KeepRecordedStage() {
  if (index_offset_ > 0) {
    recorded_stages_.push_back(
        {index_device_.get(), index_host_.get(), static_cast<size_t>(index_offset_)});
  }
}

absl::Status CudaBackend::ReserveScratch(DeviceBuffer& buffer, size_t bytes) {
  if (graph_.recording() && bytes > buffer.bytes() && buffer.get() != nullptr) {
    retired_.push_back(std::move(buffer));  // leaves `buffer` empty
  }
  return buffer.Reserve(bytes);
}

absl::Status CudaBackend::Synchronize() {
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Ok(CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", __FILE__, __LINE__));
  return status_;
}

absl::Status CudaBackend::Recover() {
  if (status_.ok() || status_.code() != absl::StatusCode::kResourceExhausted) return status_;
  // An allocation that did not fit (cudaMalloc, or cuBLAS's own) is not sticky: the ops
  // before it ran, the ones after it were never enqueued.
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  (void)cudaGetLastError();
  if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) {
    status_ = CudaStatus(e, "cudaStreamSynchronize", __FILE__, __LINE__);
    return status_;
  }
  graph_.Drop();
  status_ = absl::OkStatus();
  return status_;
}

int64_t CudaBackend::weight_bytes() const {
  std::lock_guard<std::mutex> lock(weights_->mu);
  return weights_->bytes;
}

absl::Status CudaBackend::ShareWeightsWith(CudaBackend& other) {
  if (other.device_ != device_) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot share weights between cuda:", device_, " and cuda:", other.device_));
  }
  weights_ = other.weights_;  // this backend's own cache (and its uploads) go when unused
  return absl::OkStatus();
}

absl::Status CudaBackend::AdoptWeight(const void* key, void* data, DType dtype, int64_t rows,
                                      int64_t cols) {
  if (DTypeIsBlockQuantized(dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdoptWeight: ", std::string(DTypeName(dtype)), " is not a device dtype"));
  }
  const size_t bytes = static_cast<size_t>(DTypeRowBytes(dtype, cols) * rows);
  std::lock_guard<std::mutex> lock(weights_->mu);
  DeviceWeight& dw = weights_->weights[key];
  weights_->bytes += static_cast<int64_t>(bytes) - static_cast<int64_t>(dw.buffer.bytes());
  dw.buffer = DeviceBuffer::Adopt(data, bytes);
  dw.dtype = dtype;
  dw.host_dtype = dtype;
  dw.rows = rows;
  dw.cols = cols;
  return absl::OkStatus();
}

void CudaBackend::ForgetWeights() {
  std::lock_guard<std::mutex> lock(weights_->mu);
  weights_->weights.clear();  // cudaFree waits for the device: enqueued readers finish first
  weights_->bytes = 0;
  graph_.Clear();  // graphs of steps that read them
}

absl::StatusOr<const DeviceWeight*> CudaBackend::Upload(const WeightView& w) {
  // Held through the upload: a weight is copied once, whichever sharing backend asks first.
  // The entry stays put (node-based map) after the lock is released.
  std::lock_guard<std::mutex> lock(weights_->mu);
  if (auto it = weights_->weights.find(w.data); it != weights_->weights.end()) {
    const DeviceWeight& dw = it->second;
    if (dw.rows != w.rows || dw.cols != w.cols || dw.host_dtype != w.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "weight at ", absl::Hex(reinterpret_cast<uintptr_t>(w.data)), " was uploaded as ",
          std::string(DTypeName(dw.host_dtype)), " [", dw.rows, ", ", dw.cols,
          "] and is now used as ", std::string(DTypeName(w.dtype)), " [", w.rows, ", ", w.cols,
          "] (uploads are cached by host address: ForgetWeights before reusing it)"));
    }
    return &dw;
  }
  const bool quantized = DTypeIsBlockQuantized(w.dtype);
  if (quantized && w.cols % DTypeBlockSize(w.dtype) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(DTypeName(w.dtype)), " weight has ",
                                                   w.cols, " columns, not a multiple of ",
                                                   DTypeBlockSize(w.dtype)));
  }
  DeviceWeight dw;
  dw.dtype = quantized ? DType::kF16 : w.dtype;
  dw.host_dtype = w.dtype;
  dw.rows = w.rows;
  dw.cols = w.cols;
  const size_t bytes = static_cast<size_t>(DTypeRowBytes(dw.dtype, w.cols) * w.rows);
  if (absl::Status s = dw.buffer.Reserve(bytes); !s.ok()) return s;
  if (quantized) {
    // A block type's elements decode to floats of at most one rounding (kernels/ggml_quants.h);
    // rounding them to f16 is the device copy's only other loss.
    std::vector<uint16_t> f16(static_cast<size_t>(w.rows * w.cols));
    std::vector<float> row(static_cast<size_t>(w.cols));
    for (int64_t r = 0; r < w.rows; ++r) {
      DequantizeRow(w, r, row.data());
      for (int64_t c = 0; c < w.cols; ++c) f16[r * w.cols + c] = F32ToF16(row[c]);
    }
    KVLENS_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(dw.buffer.get(), f16.data(), bytes, cudaMemcpyHostToDevice));
  } else {
    KVLENS_CUDA_RETURN_IF_ERROR(cudaMemcpy(dw.buffer.get(), w.data, bytes, cudaMemcpyHostToDevice));
  }
  // From pageable memory cudaMemcpy returns once the bytes are staged, their write to the
  // device still running on the legacy stream, which the backends' non-blocking streams
  // (the next kernel reads this weight) do not wait for.
  KVLENS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(nullptr));
  weights_->bytes += static_cast<int64_t>(dw.buffer.bytes());
  auto [it, inserted] = weights_->weights.emplace(w.data, std::move(dw));
  return &it->second;
}

absl::StatusOr<const void*> CudaBackend::UploadIndices(const void* host, size_t bytes) {
  const size_t need = RoundUp(std::max<size_t>(bytes, 1), kIndexAlign);
  for (auto it = index_recent_.rbegin(); it != index_recent_.rend(); ++it) {
    if (bytes > 0 && it->source == host && it->bytes == bytes &&
        std::memcmp(index_host_.get() + it->offset, host, bytes) == 0) {
      ++index_stats_.reused;
      return index_device_.as<unsigned char>() + it->offset;
    }
  }
  if (graph_.recording() && index_offset_ + need > index_host_.bytes()) {
    // A recorded step's staged bytes wait for copies that have not been made yet: neither
    // wrap nor free. Continue in a larger ring; the old one lives until the next step, and
    // its bytes so far are copied at the step's start too (EndStep).
    KeepRecordedStage();
    const size_t grown = RoundUp(2 * std::max(index_host_.bytes(), need), kIndexAlign);
    retired_pinned_.push_back(std::move(index_host_));
    retired_.push_back(std::move(index_device_));
    if (absl::Status s = index_host_.Reserve(grown); !s.ok()) return s;
    if (absl::Status s = index_device_.Reserve(grown); !s.ok()) return s;
    index_offset_ = 0;
    index_recent_.clear();
  }
  if (need > index_host_.bytes()) {
    // Grow both halves of the ring: wait until no copy reads the old staging memory.
    KVLENS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    const size_t grown = RoundUp(2 * need, kIndexAlign);
    if (absl::Status s = index_host_.Reserve(grown); !s.ok()) return s;
    if (absl::Status s = index_device_.Reserve(grown); !s.ok()) return s;
    index_offset_ = 0;
    index_recent_.clear();
  }
  if (index_offset_ + need > index_host_.bytes()) {
    // Wrap around: the staged bytes about to be overwritten may still be waiting for
    // their copy. (Device reuse is safe: the stream orders it after earlier readers.)
    KVLENS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    index_offset_ = 0;
    index_recent_.clear();
  }
  unsigned char* staged = index_host_.get() + index_offset_;
  unsigned char* device = index_device_.as<unsigned char>() + index_offset_;
  std::memcpy(staged, host, bytes);
  if (graph_.recording()) {
    // Staged only: EndStep copies the step's whole staged range once, before its first
    // kernel (one copy node in the step's graph, not one an array). Its place and size
    // are the step's.
    graph_.Sign(index_offset_, bytes);
  } else {
    if (absl::Status s = Launch(&CopyToDevice, static_cast<void*>(device),
                                static_cast<const void*>(staged), bytes);
        !s.ok()) {
      return s;
    }
    ++index_stats_.copies;
    index_stats_.bytes_copied += static_cast<int64_t>(bytes);
  }
  if (index_recent_.size() == kIndexReuse) index_recent_.erase(index_recent_.begin());
  index_recent_.push_back({index_offset_, bytes, host});
  index_offset_ += need;
  return device;
}

absl::Status CudaBackend::UploadPacked(std::vector<unsigned char>& pack,
                                       std::initializer_list<HostArray> arrays,
                                       const void** device) {
  constexpr size_t kAlign = 16;
  pack.clear();
  std::vector<size_t> offsets;
  offsets.reserve(arrays.size());
  for (const HostArray& a : arrays) {
    pack.resize(RoundUp(pack.size(), kAlign));
    offsets.push_back(pack.size());
    const auto* bytes = static_cast<const unsigned char*>(a.data);
    if (a.bytes > 0) pack.insert(pack.end(), bytes, bytes + a.bytes);
  }
  absl::StatusOr<const void*> d = UploadIndices(pack.data(), pack.size());
  if (!d.ok()) return d.status();
  size_t i = 0;
  for (const HostArray& a : arrays) {
    device[i] = a.bytes > 0 ? static_cast<const unsigned char*>(*d) + offsets[i] : nullptr;
    ++i;
  }
  return absl::OkStatus();
}

void CudaBackend::Embedding(const WeightView& table, const int32_t* ids, int n, float* out) {
  if (!status_.ok() || n <= 0) return;
  absl::StatusOr<const DeviceWeight*> dw = Upload(table);
  if (!Ok(dw.status())) return;
  absl::StatusOr<const void*> d_ids = UploadIndices(ids, sizeof(int32_t) * n);
  if (!Ok(d_ids.status())) return;
  Ok(Launch(&LaunchEmbedding, static_cast<const void*>((*dw)->buffer.get()), (*dw)->dtype,
            (*dw)->cols, static_cast<const int32_t*>(*d_ids), n, out));
}

void CudaBackend::RmsNorm(const float* x, int n, int dim, const WeightView& weight, double eps,
                          float* y) {
  AddRmsNorm(const_cast<float*>(x), nullptr, n, dim, weight, eps, y);  // x only read
}

void CudaBackend::AddRmsNorm(float* x, const float* residual, int n, int dim,
                             const WeightView& weight, double eps, float* y) {
  if (!status_.ok()) return;
  absl::StatusOr<const DeviceWeight*> dw = Upload(weight);
  if (!Ok(dw.status())) return;
  Ok(Launch(&LaunchAddRmsNorm, x, residual, n, dim, static_cast<const void*>((*dw)->buffer.get()),
            (*dw)->dtype, static_cast<float>(eps), y));
}

void CudaBackend::LayerNorm(const float* x, int n, int dim, const WeightView& weight,
                            const WeightView& bias, double eps, float* y) {
  AddLayerNorm(const_cast<float*>(x), nullptr, n, dim, weight, bias, eps, y);  // x only read
}

void CudaBackend::AddLayerNorm(float* x, const float* residual, int n, int dim,
                               const WeightView& weight, const WeightView& bias, double eps,
                               float* y) {
  if (!status_.ok()) return;
  absl::StatusOr<const DeviceWeight*> dw = Upload(weight);
  if (!Ok(dw.status())) return;
  const void* b = nullptr;
  if (!bias.empty()) {
    absl::StatusOr<const DeviceWeight*> db = Upload(bias);
    if (!Ok(db.status())) return;
    if ((*db)->dtype != (*dw)->dtype) {
      Ok(absl::InvalidArgumentError("LayerNorm: weight and bias must share a dtype"));
      return;
    }
    b = (*db)->buffer.get();
  }
  Ok(Launch(&LaunchAddLayerNorm, x, residual, n, dim, static_cast<const void*>((*dw)->buffer.get()),
            b, (*dw)->dtype, static_cast<float>(eps), y));
}

absl::StatusOr<RopeSpec> CudaBackend::DeviceRope(const RopeSpec& rope, int head_dim) {
  if (rope.freq_factors == nullptr) return rope;
  absl::StatusOr<const DeviceWeight*> dw =
      Upload(WeightView{rope.freq_factors, DType::kF32, 1, head_dim / 2});
  if (!dw.ok()) return dw.status();
  RopeSpec device = rope;
  device.freq_factors = static_cast<const float*>((*dw)->buffer.get());
  return device;
}

void CudaBackend::Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
                       const int32_t* positions, const RopeSpec& rope) {
  if (!status_.ok() || n <= 0) return;
  absl::StatusOr<RopeSpec> d_rope = DeviceRope(rope, head_dim);
  if (!Ok(d_rope.status())) return;
  absl::StatusOr<const void*> d_pos = UploadIndices(positions, sizeof(int32_t) * n);
  if (!Ok(d_pos.status())) return;
  Ok(Launch(&LaunchRope, x, n, row_stride, num_heads, head_dim, static_cast<const int32_t*>(*d_pos),
            *d_rope));
}

void CudaBackend::RopeQK(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride,
                         int k_heads, int n, int head_dim, const int32_t* positions,
                         const RopeSpec& rope) {
  if (!status_.ok() || n <= 0) return;
  absl::StatusOr<RopeSpec> d_rope = DeviceRope(rope, head_dim);
  if (!Ok(d_rope.status())) return;
  absl::StatusOr<const void*> d_pos = UploadIndices(positions, sizeof(int32_t) * n);
  if (!Ok(d_pos.status())) return;
  Ok(Launch(&LaunchRopeQK, q, q_stride, q_heads, k, k_stride, k_heads, n, head_dim,
            static_cast<const int32_t*>(*d_pos), *d_rope));
}

void CudaBackend::RopeQKStoreKv(float* q, int64_t q_stride, int q_heads, float* k, const float* v,
                                int64_t kv_stride, int kv_heads, int n, int head_dim,
                                const int32_t* positions, const RopeSpec& rope,
                                const int64_t* dst_rows, void* k_cache, void* v_cache,
                                int64_t cache_stride, KvDtype cache_dtype) {
  if (head_dim % 2 != 0) {  // rope leaves the last value of each head: the two plain ops
    Backend::RopeQKStoreKv(q, q_stride, q_heads, k, v, kv_stride, kv_heads, n, head_dim, positions,
                           rope, dst_rows, k_cache, v_cache, cache_stride, cache_dtype);
    return;
  }
  if (!status_.ok() || n <= 0) return;
  absl::StatusOr<RopeSpec> d_rope = DeviceRope(rope, head_dim);
  if (!Ok(d_rope.status())) return;
  // One upload (two could wrap the ring between them and overwrite the first).
  const void* d[2] = {nullptr, nullptr};
  if (!Ok(UploadPacked(rope_store_pack_,
                       {{positions, sizeof(int32_t) * n}, {dst_rows, sizeof(int64_t) * n}}, d))) {
    return;
  }
  Ok(Launch(&LaunchRopeQKStoreKv, q, q_stride, q_heads, k, v, kv_stride, kv_heads, n, head_dim,
            static_cast<const int32_t*>(d[0]), *d_rope, static_cast<const int64_t*>(d[1]), k_cache,
            v_cache, cache_stride, cache_dtype));
}

void CudaBackend::Gelu(float* x, int64_t count) {
  if (!status_.ok()) return;
  Ok(Launch(&LaunchGelu, x, count));
}

void CudaBackend::SwiGlu(const float* gate, const float* up, int64_t count, float* out) {
  if (!status_.ok()) return;
  Ok(Launch(&LaunchSwiGlu, gate, up, count, out));
}

void CudaBackend::GeGlu(const float* gate, const float* up, int64_t count, float* out) {
  if (!status_.ok()) return;
  Ok(Launch(&LaunchGeGlu, gate, up, count, out));
}

void CudaBackend::SoftCap(float* x, int64_t count, double cap) {
  if (!status_.ok()) return;
  Ok(Launch(&LaunchSoftCap, x, count, cap));
}

void CudaBackend::Scale(float* x, int64_t count, double factor) {
  if (!status_.ok()) return;
  Ok(Launch(&LaunchScale, x, count, factor));
}

void CudaBackend::Add(float* y, const float* x, int64_t count) {
  if (!status_.ok()) return;
  Ok(Launch(&LaunchAdd, y, x, count));
}

void CudaBackend::Copy(float* dst, const float* src, int64_t count) {
  if (!status_.ok() || count <= 0) return;
  Ok(Launch(&CopyOnDevice, static_cast<void*>(dst), static_cast<const void*>(src),
            sizeof(float) * static_cast<size_t>(count)));
}

absl::Status CudaBackend::AddRows(float* y, int n, int64_t dim, const float* rows, int num_rows,
                                  const int32_t* index) {
  if (absl::Status s = CheckAddRows(n, dim, num_rows, index); !s.ok()) return s;
  if (!status_.ok() || n == 0 || dim == 0 || num_rows == 0) return status_;
  const void* device[2];
  if (!Ok(UploadPacked(add_rows_pack_,
                       {{rows, sizeof(float) * static_cast<size_t>(num_rows * dim)},
                        {index, sizeof(int32_t) * static_cast<size_t>(n)}},
                       device))) {
    return status_;
  }
  Ok(Launch(&LaunchAddRows, y, n, dim, static_cast<const float*>(device[0]),
            static_cast<const int32_t*>(device[1])));
  return status_;
}

absl::Status CudaBackend::DrawTokens(const float* logits, int rows, int vocab,
                                     const TokenDraw* draws, int32_t* token, float* logprob,
                                     int32_t* top_token, float* top_logprob) {
  if (rows < 0 || vocab <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DrawTokens: rows = ", rows, " must be >= 0 and vocab = ", vocab, " >= 1"));
  }
  if (absl::Status s = CheckDraws(rows, vocab, draws, top_token, top_logprob); !s.ok()) return s;
  if (graph_.recording()) {
    return absl::FailedPreconditionError("DrawTokens: called while a step is being recorded");
  }
  if (vocab > kDrawMaxVocab) {
    // Past the kernel's fixed-point range: the rows go to the host.
    return Backend<float>::DrawTokens(logits, rows, vocab, draws, token, logprob, top_token,
                                      top_logprob);
  }
  if (!status_.ok() || rows == 0) return Synchronize();
  draw_host_.resize(static_cast<size_t>(rows));
  bias_host_.clear();
  penalty_host_.clear();
  bool any_top = false;
  int adjusted_rows = 0;  // rows with a bias or penalties, each its own row of draw_adjusted_
  for (int r = 0; r < rows; ++r) {
    DeviceDraw& d = draw_host_[static_cast<size_t>(r)];
    d = ToDeviceDraw(draws[r]);
    any_top = any_top || draws[r].top_logprobs > 0;
    if (draws[r].forced_token >= 0) continue;  // (no bias, no penalties)
    d.bias_offset = static_cast<int32_t>(bias_host_.size());
    d.bias_count = static_cast<int32_t>(draws[r].logit_bias.size());
    for (const auto& [id, value] : draws[r].logit_bias) bias_host_.push_back({id, value});
    if (draws[r].HasPenalties()) {
      d.penalty_offset = static_cast<int32_t>(penalty_host_.size());
      d.penalty_count = static_cast<int32_t>(draws[r].token_counts.size());
      for (const auto& [id, count] : draws[r].token_counts) penalty_host_.push_back({id, count});
    }
    if (d.bias_count > 0 || d.penalty_count > 0) d.adjusted_row = adjusted_rows++;
  }
  // One upload (two could wrap or grow the ring between them and lose the first).
  const void* d[3] = {nullptr, nullptr, nullptr};
  if (!Ok(UploadPacked(draw_pack_,
                       {{draw_host_.data(), sizeof(DeviceDraw) * draw_host_.size()},
                        {bias_host_.data(), sizeof(DeviceBias) * bias_host_.size()},
                        {penalty_host_.data(), sizeof(DevicePenalty) * penalty_host_.size()}},
                       d))) {
    return status_;
  }
  const auto* d_draws = static_cast<const DeviceDraw*>(d[0]);
  const auto* d_bias = static_cast<const DeviceBias*>(d[1]);
  const auto* d_penalties = static_cast<const DevicePenalty*>(d[2]);
  float* d_adjusted = nullptr;
  if (adjusted_rows > 0 && vocab > kDrawCachedVocab) {
    if (!Ok(ReserveScratch(draw_adjusted_,
                           sizeof(float) * static_cast<size_t>(adjusted_rows) * vocab))) {
      return status_;
    }
    d_adjusted = draw_adjusted_.as<float>();
  }
  // Tokens, then log-probabilities, then (when asked) the top tokens and theirs: one copy
  // back, 8 bytes a row (and 160 more with top log-probabilities).
  const size_t per_row = any_top ? 2 + 2 * kMaxTopLogprobs : 2;
  const size_t bytes = sizeof(int32_t) * static_cast<size_t>(rows) * per_row;
  if (!Ok(ReserveScratch(pick_device_, bytes))) return status_;
  int32_t* d_token = pick_device_.as<int32_t>();
  float* d_logprob = reinterpret_cast<float*>(d_token + rows);
  int32_t* d_top_token = any_top ? d_token + 2 * rows : nullptr;
  float* d_top_logprob =
      any_top ? reinterpret_cast<float*>(d_top_token + rows * kMaxTopLogprobs) : nullptr;
  if (!Ok(Launch(&LaunchDrawTokens, logits, rows, vocab, d_draws, d_bias, d_penalties, d_adjusted,
                 d_token, d_logprob, d_top_token, d_top_logprob))) {
    return status_;
  }
  pick_host_.resize(static_cast<size_t>(rows) * per_row);
  if (!Ok(memory_.CopyToHost(pick_host_.data(), d_token, bytes))) return status_;
  std::memcpy(token, pick_host_.data(), sizeof(int32_t) * rows);
  std::memcpy(logprob, pick_host_.data() + rows, sizeof(float) * rows);
  if (any_top) {
    const size_t top = static_cast<size_t>(rows) * kMaxTopLogprobs;
    std::memcpy(top_token, pick_host_.data() + 2 * rows, sizeof(int32_t) * top);
    std::memcpy(top_logprob, pick_host_.data() + 2 * rows + top, sizeof(float) * top);
  }
  return status_;
}

void CudaBackend::StoreKv(const float* k, const float* v, int n, int64_t src_stride,
                          int64_t row_elems, const int64_t* dst_rows, void* k_cache, void* v_cache,
                          int64_t cache_stride, KvDtype cache_dtype) {
  if (!status_.ok() || n <= 0) return;
  absl::StatusOr<const void*> d_rows = UploadIndices(dst_rows, sizeof(int64_t) * n);
  if (!Ok(d_rows.status())) return;
  Ok(Launch(&LaunchStoreKv, k, v, n, src_stride, row_elems, static_cast<const int64_t*>(*d_rows),
            k_cache, v_cache, cache_stride, cache_dtype));
}

}  // namespace kvlens::kernels::cuda
