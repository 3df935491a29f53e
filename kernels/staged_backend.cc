#include "kernels/staged_backend.h"

#include <algorithm>

#include "kernels/attention_check.h"
#include "kernels/cpu/reference_backward.h"

namespace kvlens::kernels {

StagedBackend::StagedBackend(Backend<float>& device, Backend<float>& host,
                             BackwardOps<float>* device_backward)
    : device_(device),
      host_(host),
      device_backward_(device_backward),
      name_("staged:" + std::string(device.name())) {
  for (Buffer<float>& b : scratch_) b = Buffer<float>(device.memory());
}

namespace {

// The cache rows an attention call over `num_keys` keys reads: the logical keys, or every
// row of the blocks the table names (the staged extent).
int64_t CacheRowsRead(const KvSource<float>& kv, int num_keys) {
  if (kv.block_table == nullptr) return num_keys;
  int64_t rows = 0;
  for (int b = 0; b * kv.block_size < num_keys; ++b) {
    rows = std::max<int64_t>(rows, (int64_t{kv.block_table[b]} + 1) * kv.block_size);
  }
  return rows;
}

}  // namespace

bool StagedBackend::Ok(const absl::Status& s) {
  if (!s.ok() && status_.ok()) status_ = s;
  return status_.ok();
}

absl::Status StagedBackend::Synchronize() {
  Ok(device_.Synchronize());
  return status_;
}

absl::Status StagedBackend::Recover() {
  const absl::Status device = device_.Recover();
  if (status_.ok() || status_.code() == absl::StatusCode::kResourceExhausted) status_ = device;
  return status_;
}

float* StagedBackend::Stage(int slot, const float* host, int64_t count) {
  Buffer<float>& b = scratch_[static_cast<size_t>(slot)];
  if (!Ok(b.Resize(count))) return nullptr;
  if (host != nullptr && count > 0 && !Ok(b.CopyFromHost(host, count))) return nullptr;
  return b.data();
}

void StagedBackend::Fetch(float* host, int slot, int64_t count) {
  if (!status_.ok() || count <= 0) return;
  // The device op's own failure first: its output is not worth copying.
  if (!Ok(device_.Synchronize())) return;
  Ok(scratch_[static_cast<size_t>(slot)].CopyToHost(host, count));
}

void StagedBackend::MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
                           float* y) {
  if (!status_.ok() || n <= 0 || !Ok(device_.MakeCurrent())) return;
  const float* dx = Stage(0, x, n * w.cols);
  float* dy = Stage(1, nullptr, n * w.rows);
  if (dx == nullptr || dy == nullptr) return;
  device_.MatMul(dx, n, w, bias, dy);
  Fetch(y, 1, n * w.rows);
}

void StagedBackend::Embedding(const WeightView& table, const int32_t* ids, int n, float* out) {
  if (!status_.ok() || n <= 0 || !Ok(device_.MakeCurrent())) return;
  float* d = Stage(0, nullptr, n * table.cols);
  if (d == nullptr) return;
  device_.Embedding(table, ids, n, d);  // ids: a host array, as for every backend
  Fetch(out, 0, n * table.cols);
}

void StagedBackend::RmsNorm(const float* x, int n, int dim, const WeightView& weight, double eps,
                            float* y) {
  if (!status_.ok() || n <= 0 || !Ok(device_.MakeCurrent())) return;
  const int64_t count = int64_t{n} * dim;
  const float* dx = Stage(0, x, count);
  float* dy = Stage(1, nullptr, count);
  if (dx == nullptr || dy == nullptr) return;
  device_.RmsNorm(dx, n, dim, weight, eps, dy);
  Fetch(y, 1, count);
}

void StagedBackend::LayerNorm(const float* x, int n, int dim, const WeightView& weight,
                              const WeightView& bias, double eps, float* y) {
  if (!status_.ok() || n <= 0 || !Ok(device_.MakeCurrent())) return;
  const int64_t count = int64_t{n} * dim;
  const float* dx = Stage(0, x, count);
  float* dy = Stage(1, nullptr, count);
  if (dx == nullptr || dy == nullptr) return;
  device_.LayerNorm(dx, n, dim, weight, bias, eps, dy);
  Fetch(y, 1, count);
}

void StagedBackend::Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
                         const int32_t* positions, const RopeSpec& rope) {
  if (!status_.ok() || n <= 0 || !Ok(device_.MakeCurrent())) return;
  // Rows row_stride apart; the last row ends after its heads.
  const int64_t count = (n - 1) * row_stride + int64_t{num_heads} * head_dim;
  float* d = Stage(0, x, count);
  if (d == nullptr) return;
  device_.Rope(d, n, row_stride, num_heads, head_dim, positions, rope);
  Fetch(x, 0, count);
}

void StagedBackend::Gelu(float* x, int64_t count) {
  if (!status_.ok() || count <= 0 || !Ok(device_.MakeCurrent())) return;
  float* d = Stage(0, x, count);
  if (d == nullptr) return;
  device_.Gelu(d, count);
  Fetch(x, 0, count);
}

void StagedBackend::SwiGlu(const float* gate, const float* up, int64_t count, float* out) {
  if (!status_.ok() || count <= 0 || !Ok(device_.MakeCurrent())) return;
  const float* dg = Stage(0, gate, count);
  const float* du = Stage(1, up, count);
  float* dout = Stage(2, nullptr, count);
  if (dg == nullptr || du == nullptr || dout == nullptr) return;
  device_.SwiGlu(dg, du, count, dout);
  Fetch(out, 2, count);
}

void StagedBackend::GeGlu(const float* gate, const float* up, int64_t count, float* out) {
  if (!status_.ok() || count <= 0 || !Ok(device_.MakeCurrent())) return;
  const float* dg = Stage(0, gate, count);
  const float* du = Stage(1, up, count);
  float* dout = Stage(2, nullptr, count);
  if (dg == nullptr || du == nullptr || dout == nullptr) return;
  device_.GeGlu(dg, du, count, dout);
  Fetch(out, 2, count);
}

void StagedBackend::SoftCap(float* x, int64_t count, double cap) {
  if (!status_.ok() || count <= 0 || !Ok(device_.MakeCurrent())) return;
  float* d = Stage(0, x, count);
  if (d == nullptr) return;
  device_.SoftCap(d, count, cap);
  Fetch(x, 0, count);
}

void StagedBackend::Scale(float* x, int64_t count, double factor) {
  if (!status_.ok() || count <= 0 || !Ok(device_.MakeCurrent())) return;
  float* d = Stage(0, x, count);
  if (d == nullptr) return;
  device_.Scale(d, count, factor);
  Fetch(x, 0, count);
}

void StagedBackend::Add(float* y, const float* x, int64_t count) {
  if (!status_.ok() || count <= 0 || !Ok(device_.MakeCurrent())) return;
  float* dy = Stage(0, y, count);
  const float* dx = Stage(1, x, count);
  if (dy == nullptr || dx == nullptr) return;
  device_.Add(dy, dx, count);
  Fetch(y, 0, count);
}

void StagedBackend::StoreKv(const float* k, const float* v, int n, int64_t src_stride,
                            int64_t row_elems, const int64_t* dst_rows, void* k_cache,
                            void* v_cache, int64_t cache_stride, KvDtype cache_dtype) {
  if (!status_.ok()) return;
  host_.StoreKv(k, v, n, src_stride, row_elems, dst_rows, k_cache, v_cache, cache_stride,
                cache_dtype);
}

absl::Status StagedBackend::Attention(const AttentionArgs<float>& a) {
  if (!status_.ok()) return status_;
  // A bf16 cache's rows (2 bytes an element) are read where they are.
  if (a.kv.dtype != KvDtype::kActivation) return host_.Attention(a);
  // The host arguments' own errors first (they also bound the sizes staged below).
  if (absl::Status s = ValidateAttentionArgs(a); !s.ok()) return s;
  if (a.num_queries <= 0 || !Ok(device_.MakeCurrent())) return status_;
  const int64_t q_row = int64_t{a.num_heads} * a.head_dim;
  const int64_t kv_row = int64_t{a.num_kv_heads} * a.head_dim;
  const int64_t map = int64_t{a.num_heads} * a.num_queries * a.num_keys;
  const int64_t cache_rows = CacheRowsRead(a.kv, a.num_keys);
  const int64_t out_count = (a.num_queries - 1) * a.out_stride + q_row;
  AttentionArgs<float> d = a;  // the block table and document ids stay host arrays
  d.q = Stage(0, a.q, (a.num_queries - 1) * a.q_stride + q_row);
  d.kv.k = Stage(1, static_cast<const float*>(a.kv.k), (cache_rows - 1) * a.kv.row_stride + kv_row);
  d.kv.v = Stage(2, static_cast<const float*>(a.kv.v), (cache_rows - 1) * a.kv.row_stride + kv_row);
  // (The slots AttentionBackward stages the same sizes in: the maps' device scratch is
  // shared, never a second set.)
  d.out = Stage(4, a.out, out_count);  // (copied in too: what lies between rows stays)
  d.probs = a.probs != nullptr ? Stage(8, nullptr, map) : nullptr;
  d.scores = a.scores != nullptr ? Stage(9, nullptr, map) : nullptr;
  if (!status_.ok()) return status_;
  if (absl::Status s = device_.Attention(d); !s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument) Ok(s);
    return s;
  }
  Fetch(a.out, 4, out_count);
  if (a.probs != nullptr) Fetch(a.probs, 8, map);
  if (a.scores != nullptr) Fetch(a.scores, 9, map);
  return status_;
}

absl::Status StagedBackend::MatMulBackwardInput(const float* dy, int n, const WeightView& w,
                                                float* dx) {
  if (device_backward_ == nullptr) {
    kernels::MatMulBackwardInput(dy, n, w, dx);
    return absl::OkStatus();
  }
  if (!status_.ok()) return status_;
  if (n <= 0 || !Ok(device_.MakeCurrent())) return status_;
  const float* ddy = Stage(0, dy, n * w.rows);
  float* ddx = Stage(1, dx, n * w.cols);  // accumulated into: its current values go too
  if (ddy == nullptr || ddx == nullptr) return status_;
  if (!Ok(device_backward_->MatMulBackwardInput(ddy, n, w, ddx))) return status_;
  Fetch(dx, 1, n * w.cols);
  return status_;
}

absl::Status StagedBackend::AttentionBackward(const AttentionBackwardArgs<float>& a) {
  if (device_backward_ == nullptr) return kernels::AttentionBackward(a);
  if (!status_.ok()) return status_;
  // The host arguments' own errors first (they also bound the sizes staged below).
  if (absl::Status s = ValidateAttentionBackwardArgs(a); !s.ok()) return s;
  if (!Ok(device_.MakeCurrent())) return status_;
  const int64_t q_row = int64_t{a.num_heads} * a.head_dim;
  const int64_t kv_row = int64_t{a.num_kv_heads} * a.head_dim;
  const int64_t map = int64_t{a.num_heads} * a.num_queries * a.num_keys;
  const int64_t cache_rows = CacheRowsRead(a.kv, a.num_keys);
  AttentionBackwardArgs<float> d = a;
  d.q = Stage(0, a.q, (a.num_queries - 1) * a.q_stride + q_row);
  d.kv.k = Stage(1, static_cast<const float*>(a.kv.k), (cache_rows - 1) * a.kv.row_stride + kv_row);
  d.kv.v = Stage(2, static_cast<const float*>(a.kv.v), (cache_rows - 1) * a.kv.row_stride + kv_row);
  d.probs = Stage(3, a.probs, map);
  d.dout = Stage(4, a.dout, (a.num_queries - 1) * a.dout_stride + q_row);
  d.dq = Stage(5, nullptr, a.num_queries * q_row);
  d.dk = Stage(6, nullptr, a.num_keys * kv_row);
  d.dv = Stage(7, nullptr, a.num_keys * kv_row);
  d.dprobs = a.dprobs != nullptr ? Stage(8, nullptr, map) : nullptr;
  d.dscores = a.dscores != nullptr ? Stage(9, nullptr, map) : nullptr;
  if (!status_.ok()) return status_;
  if (absl::Status s = device_backward_->AttentionBackward(d); !s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument) Ok(s);
    return s;
  }
  Fetch(a.dq, 5, a.num_queries * q_row);
  Fetch(a.dk, 6, a.num_keys * kv_row);
  Fetch(a.dv, 7, a.num_keys * kv_row);
  if (a.dprobs != nullptr) Fetch(a.dprobs, 8, map);
  if (a.dscores != nullptr) Fetch(a.dscores, 9, map);
  return status_;
}

}  // namespace kvlens::kernels
