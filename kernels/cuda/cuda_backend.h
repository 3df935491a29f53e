// The CUDA backend: Backend<float> on one NVIDIA GPU.
//
// Memory contract (differs from the CPU backends):
//   - activations (x, y, q, out, gate, up, …), the KV cache (KvSource k/v, StoreKv's
//     caches) and the optional probs/scores outputs are DEVICE pointers (plain cudaMalloc;
//     never managed memory);
//   - index arrays are HOST pointers: Embedding ids, Rope positions, StoreKv dst_rows,
//     AttentionArgs block_table and doc ids. They are small, the host needs them anyway to
//     validate (negative block ids, rows with no visible key), and they are uploaded per
//     call through a pinned ring on the backend's stream;
//   - weights are HOST WeightViews (the loaded model); each is uploaded on first use and
//     cached, keyed by its data pointer, keeping its dtype (f32, f16, bf16; ggml's block
//     types, q8_0 and q4_K alike, are dequantised to f16 at upload). A view of part of a tensor is
//     a separate upload.
//
// Every op is enqueued on one stream and returns without waiting. The void ops cannot
// return a Status: their first failure is kept (status()) and makes every later op a
// no-op; Attention returns it, and Synchronize() waits for the stream and returns it.
// Recover(), at the start of the next unit of work, clears an out-of-memory failure (the
// device stays usable) and keeps any other. Not thread-safe: one engine thread drives one backend.
//
// CUDA graphs: between BeginStep and EndStep (the engine's forward step) the launches are
// recorded and run by StepGraph (step_graph.h): a step that makes exactly the launches of
// an earlier one is one cudaGraphLaunch of the graph captured the second time it was seen.
// To make decode steps repeat while their sequences grow, a recorded step's split-KV
// attention pads each sequence's block table to a power of two of blocks and splits that
// span (rows stop at their own key end). SetCudaGraphs(false) turns all of this off.
//
// Precision: fp32 activations; MatMul on cuBLAS with fp32 accumulation (f32 weights: fp32
// GEMM, no TF32; f16/bf16 weights: activations rounded to the weight dtype for the tensor
// cores, except for n <= kMatVecMaxRows rows, where matvec.cu keeps them fp32); prefill
// attention on fp16 tensor cores with fp32 softmax; decode attention and the
// probability-materialising attention in fp32.
#ifndef KVLENS_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVLENS_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/attention_backward.h"
#include "kernels/backend.h"
#include "kernels/backward_ops.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/cuda_memory.h"
#include "kernels/cuda/device_buffer.h"
#include "kernels/cuda/draw_tokens.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/step_graph.h"

struct cublasContext;

namespace kvlens::kernels::cuda {

// One uploaded weight: [rows, cols] row-major on the device in `dtype` (never a block type).
struct DeviceWeight {
  DeviceBuffer buffer;
  DType dtype = DType::kF32;       // on the device (a block type's copy is f16)
  DType host_dtype = DType::kF32;  // as the WeightView named it
  int64_t rows = 0;
  int64_t cols = 0;
};

// Uploaded weights by host address (WeightView::data). The backends of one device may
// share one cache (CudaBackend::ShareWeightsWith), so the engine's backend and the
// interpretability workers' hold one copy; lookups and uploads take the mutex.
struct WeightCache {
  std::mutex mu;
  std::unordered_map<const void*, DeviceWeight> weights;  // guarded by mu
  int64_t bytes = 0;                                      // guarded by mu
};

// The kernels' parameters for attention call `a`, its index arrays (block table,
// documents) not uploaded: null.
AttentionParams HostAttentionParams(const AttentionArgs<float>& a);

// The attention kernels' options that TuneAttention chooses among (each also has a setter
// of its own on CudaBackend): the flash kernels' layout and block order, and split-KV's
// warps, fused combine, tensor cores and balanced splits; and whether prefill over an
// fp32 cache runs on an fp16 copy of its blocks. As constructed: the defaults.
struct AttentionKernels {
  FlashBf16Layout flash_layout;
  int flash_head_group = 1;
  bool flash_f16_copy = false;
  int split_kv_warps = kSplitKvWarps;
  bool split_kv_fused_combine = false;
  bool split_kv_tensor_cores = false;
  bool split_kv_balanced = false;
};

class CudaBackend final : public Backend<float>, public BackwardOps<float> {
 public:
  // FAILED_PRECONDITION when there is no usable device `device` (no driver, no GPU).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device = 0);
  ~CudaBackend() override;

  std::string_view name() const override { return name_; }
  // Device memory: the engine allocates activations and the KV cache here.
  Memory& memory() override { return memory_; }
  // Makes this backend's device current on the calling thread.
  absl::Status MakeCurrent() override;
  // e.g. "NVIDIA H200".
  const std::string& device_name() const { return device_name_; }
  int device() const { return device_; }
  int num_sms() const { return num_sms_; }
  cudaStream_t stream() const { return stream_; }
  // The first failure of any op so far (OK when none).
  absl::Status status() const { return status_; }
  // Waits for every enqueued op; returns the first failure.
  absl::Status Synchronize() override;
  // Clears a RESOURCE_EXHAUSTED failure once the stream has finished (a recording step is
  // dropped); returns any other failure, kept.
  absl::Status Recover() override;
  // Bytes of device memory held by uploaded weights (of the shared cache, if shared).
  int64_t weight_bytes() const;
  // From now on use (and fill) `other`'s weight cache, dropping this backend's own uploads:
  // backends of one device then hold one copy of each weight. INVALID_ARGUMENT when the
  // two are on different devices.
  absl::Status ShareWeightsWith(CudaBackend& other);

  // Registers weights that already live on the device under a host key, as if
  // WeightView{key, dtype, rows, cols} had been uploaded: for loaders that upload
  // themselves and for benchmarks. Takes ownership of `data` (a cudaMalloc allocation).
  absl::Status AdoptWeight(const void* key, void* data, DType dtype, int64_t rows, int64_t cols);
  // Uploads are cached by host address, so a weight's host memory must stay alive and
  // unchanged while this backend may use it. Whoever frees weights (and may allocate new
  // ones at the same addresses) first drops the cache: every uploaded or adopted weight's
  // device memory is freed once the work already enqueued is done.
  void ForgetWeights();

  // Host-to-device copies of index arrays (ids, positions, cache rows, block tables,
  // document ids) since Create, and the uploads served by an earlier identical copy.
  struct IndexUploadStats {
    int64_t copies = 0;
    int64_t bytes_copied = 0;
    int64_t reused = 0;
  };
  IndexUploadStats index_upload_stats() const { return index_stats_; }
  // Queries per flash prefill block: 64, 128 (the default) or, on the bf16 kernel only,
  // 192 (12 warps), where the head size allows (attention.h, FlashTileQueries and
  // FlashBf16TileQueries; elsewhere 192 asks for 128). For kvlens_gpu_check's comparison
  // and the tests.
  absl::Status SetFlashTileQueries(int queries);
  // Whether prefill over a bf16 cache takes the bf16 flash kernel where it applies
  // (FlashPrefillBf16Supports; on by default) or the fp16 one that converts each element.
  // For kvlens_gpu_check's comparison and the tests.
  void SetFlashBf16(bool on) { flash_bf16_ = on; }
  bool flash_bf16() const { return flash_bf16_; }
  // Whether flash prefill over an fp32 cache copies the blocks it reads to fp16 first and
  // runs the bf16 kernel's loop on fp16 tensor cores over the copies, in the bf16 kernel's
  // layouts (kv_f16_copy.h), rather than the fp16 kernel, which converts each tile as the
  // block waits. The same rounding; off by default until a GPU has timed it
  // (kvlens_gpu_check's rows "prefill attention (causal, fp32 in, fp16 copy, …)").
  // A launch whose copies' workspace does not fit in device memory runs on the fp16 kernel
  // instead (counted by flash_f16_copy_fallbacks): the copy never fails a call.
  void SetFlashF16Copy(bool on) { kernels_.flash_f16_copy = on; }
  bool flash_f16_copy() const { return kernels_.flash_f16_copy; }
  int64_t flash_f16_copy_fallbacks() const { return flash_f16_copy_fallbacks_; }
  // Queries a warp of the bf16 flash kernel takes in a 128-query block: 16 (8 warps; the
  // default) or 32 (4 warps). attention.h, LaunchFlashPrefillBf16. For kvlens_gpu_check's
  // comparison and the tests.
  absl::Status SetFlashWarpQueries(int queries);
  // K/V stages of the bf16 flash kernel's 128-query blocks: 2 (the default; two barriers
  // a tile) or kFlashMaxStages (one). attention.h, LaunchFlashPrefillBf16. For
  // kvlens_gpu_check's comparison and the tests.
  absl::Status SetFlashStages(int stages);
  // Keys a tile of the bf16 flash kernel's 8 warps of 16 queries: 64 (the default; Q in
  // registers, one block an SM) or kFlashNarrowKeyTile (Q in shared memory, two blocks an
  // SM). attention.h. For kvlens_gpu_check's comparison and the tests.
  absl::Status SetFlashKeyTile(int keys);
  // All four at once (FlashBf16Layout{} restores the defaults); nothing changes on error.
  absl::Status SetFlashLayout(const FlashBf16Layout& layout);
  const FlashBf16Layout& flash_layout() const { return kernels_.flash_layout; }
  // The order both flash kernels start their blocks in (attention.h, FlashGrid): 1 (the
  // default, as timed so far) head by head; G > 1: the longest blocks of G heads first;
  // kFlashAutoHeadGroup: G sized to the device's L2 cache (FlashHeadGroup). Untimed on a GPU
  // (modelled: see FlashGrid); --attention-tune and kvlens_gpu_check time it. The
  // outputs are the same bits whatever the order.
  absl::Status SetFlashHeadGroup(int heads);
  int flash_head_group() const { return kernels_.flash_head_group; }
  // The device's L2 cache (cudaDeviceProp::l2CacheSize), which kFlashAutoHeadGroup fills.
  int64_t l2_bytes() const { return l2_bytes_; }
  // Key splits of every split-KV launch: 0 (the default) lets ChooseNumSplits decide, else
  // 1 … kSplitKvMaxSplits. For kvlens_gpu_check's sweep of the decode kernel.
  absl::Status SetSplitKvSplits(int splits);
  // Whether the split-KV launch merges its splits itself (the last block of each row and
  // KV head to finish; LaunchSplitKv's `arrivals`) instead of a second launch. Off by
  // default until a GPU has timed it (kvlens_gpu_check's decode rows).
  void SetSplitKvFusedCombine(bool on) { kernels_.split_kv_fused_combine = on; }
  bool split_kv_fused_combine() const { return kernels_.split_kv_fused_combine; }
  // Warps of a split-KV block asked for: kSplitKvWarps (the default) or kSplitKvWideWarps
  // (one block an SM, a quarter of the splits; where the head tile allows: attention.h).
  // Off the default until a GPU has timed it (kvlens_gpu_check's decode rows).
  absl::Status SetSplitKvWarps(int warps);
  int split_kv_warps() const { return kernels_.split_kv_warps; }
  // Whether split-KV launches run on tensor cores where they can (SplitKvMmaSupports: head
  // sizes 64, 128 and 256, cache rows in pieces of 8 elements; attention.h): Q, K, P and V
  // rounded to bf16 on a bf16 cache, to fp16 on fp32, as the flash kernels round them on
  // those caches; the warps option does not apply there. Off by default until a GPU has
  // timed it (kvlens_gpu_check's decode rows).
  void SetSplitKvTensorCores(bool on) { kernels_.split_kv_tensor_cores = on; }
  bool split_kv_tensor_cores() const { return kernels_.split_kv_tensor_cores; }
  // Whether a batched split-KV launch of unequal rows takes more splits: as many as one
  // wave would take with SplitKvImbalance times the blocks on each SM (attention.h), so
  // that a long row's blocks do not run alone at the end. Off by default until a GPU has
  // timed it (kvlens_gpu_check's row "decode attention, unequal batch"); the choice for
  // equal rows is the same either way.
  void SetSplitKvBalanced(bool on) { kernels_.split_kv_balanced = on; }
  bool split_kv_balanced() const { return kernels_.split_kv_balanced; }
  // Those options all at once: AttentionKernels{} restores the defaults; nothing changes
  // on error (INVALID_ARGUMENT naming the option). A backend made to share another's
  // weights takes its kernels too (CreateBackend), so the interpretability workers run
  // what --attention-tune chose for serving.
  absl::Status SetAttentionKernels(const AttentionKernels& k);
  const AttentionKernels& attention_kernels() const { return kernels_; }

  // The forward step's launches, recorded and run as a CUDA graph when an identical step
  // ran before (see the top of the file). On by default.
  void SetCudaGraphs(bool on);
  // Programmatic dependent launch for every kernel launch of the process (launch.h; off by
  // default): drops this backend's graphs, which keep the mode they were captured with.
  void SetProgrammaticLaunches(bool on);
  // Their prefetches before the wait (launch.h; on by default), likewise process-wide.
  void SetLaunchPrefetches(bool on);
  bool cuda_graphs() const { return graphs_enabled_; }
  StepGraph::Stats graph_stats() const { return graph_.stats(); }
  void BeginStep() override;
  // With graphs on: 1, 2, 4, then multiples of 8 up to 512 (vLLM's capture sizes).
  int PaddedDecodeRows(int n) const override;
  absl::Status EndStep(bool run) override;

  void MatMul(const float* x, int n, const WeightView& w, const WeightView& bias,
              float* y) override;
  void Embedding(const WeightView& table, const int32_t* ids, int n, float* out) override;
  void RmsNorm(const float* x, int n, int dim, const WeightView& weight, double eps,
               float* y) override;
  void LayerNorm(const float* x, int n, int dim, const WeightView& weight, const WeightView& bias,
                 double eps, float* y) override;
  void Rope(float* x, int n, int64_t row_stride, int num_heads, int head_dim,
            const int32_t* positions, const RopeSpec& rope) override;
  // Up to kMatVecMaxRows rows, f16/bf16 weights of one dtype and width, at most
  // kMatVecMaxSegments products: one matvec launch (LaunchMatVec); else MatMul each.
  void MatMulMany(const float* x, int n, absl::Span<const MatMulOutput<float>> outputs) override;
  // The q/k/v matvec (as MatMulMany) normalizes x itself where the rows fit
  // (MatVecNormFits): no RmsNorm launch, xn unwritten. Else RmsNorm, then MatMulMany.
  void RmsNormMatMulMany(const float* x, int n, int dim, const WeightView& norm, double eps,
                         float* xn, absl::Span<const MatMulOutput<float>> outputs) override;
  // That matvec, its epilogue also turning q and k and storing k and v into the cache
  // (LaunchMatVecRopeStore: heads of a multiple of 4, in % 8 == 0); else
  // RmsNormMatMulMany, then RopeQKStoreKv. MatMulQkvRopeStoreKv likewise without the norm.
  void RmsNormQkvRopeStoreKv(const float* x, int n, int dim, const WeightView& norm, double eps,
                             float* xn, absl::Span<const MatMulOutput<float>> qkv,
                             const QkvRopeStore& kv) override;
  void MatMulQkvRopeStoreKv(const float* x, int n, absl::Span<const MatMulOutput<float>> qkv,
                            const QkvRopeStore& kv) override;
  // The gated matvec normalizes x itself likewise (else RmsNorm, then MatMulSwiGlu/GeGlu).
  void RmsNormMatMulSwiGlu(const float* x, int n, int dim, const WeightView& norm, double eps,
                           float* xn, const WeightView& w_gate, const WeightView& w_up,
                           float* up_scratch, float* out) override;
  void RmsNormMatMulGeGlu(const float* x, int n, int dim, const WeightView& norm, double eps,
                          float* xn, const WeightView& w_gate, const WeightView& w_up,
                          float* up_scratch, float* out) override;
  // The matvec adds its outputs into y (n ≤ kMatVecMaxRows on f16/bf16 weights); else the
  // GEMM accumulates into y (β = 1), then the bias. scratch unused.
  void MatMulAddTo(const float* x, int n, const WeightView& w, const WeightView& bias,
                   float* scratch, float* y) override;
  // One RoPE launch for both (positions uploaded once).
  void RopeQK(float* q, int64_t q_stride, int q_heads, float* k, int64_t k_stride, int k_heads,
              int n, int head_dim, const int32_t* positions, const RopeSpec& rope) override;
  // One kernel each: the residual add inside the norm's row pass.
  void AddRmsNorm(float* x, const float* residual, int n, int dim, const WeightView& weight,
                  double eps, float* y) override;
  void AddLayerNorm(float* x, const float* residual, int n, int dim, const WeightView& weight,
                    const WeightView& bias, double eps, float* y) override;
  // Up to kMatVecMaxRows rows on f16/bf16 weights: one matvec launch computing both
  // products and the gate (LaunchMatVecGated); else two GEMMs and SwiGlu (GeGlu).
  void MatMulSwiGlu(const float* x, int n, const WeightView& w_gate, const WeightView& w_up,
                    float* up_scratch, float* out) override;
  void MatMulGeGlu(const float* x, int n, const WeightView& w_gate, const WeightView& w_up,
                   float* up_scratch, float* out) override;
  // The matvec's epilogue applies the GELU (n ≤ kMatVecMaxRows on f16/bf16 weights); else
  // MatMul's GEMM, then Gelu.
  void MatMulGelu(const float* x, int n, const WeightView& w, const WeightView& bias,
                  float* y) override;
  void Gelu(float* x, int64_t count) override;
  void SwiGlu(const float* gate, const float* up, int64_t count, float* out) override;
  void GeGlu(const float* gate, const float* up, int64_t count, float* out) override;
  void Scale(float* x, int64_t count, double factor) override;
  void SoftCap(float* x, int64_t count, double cap) override;
  void Add(float* y, const float* x, int64_t count) override;
  void Copy(float* dst, const float* src, int64_t count) override;  // a device-to-device copy
  // The rows and index staged in one upload (UploadPacked): in a recorded step with its
  // index arrays, so a steered step replays as a graph with each step's rows.
  absl::Status AddRows(float* y, int n, int64_t dim, const float* rows, int num_rows,
                       const int32_t* index) override;
  // One launch (rope, then k's and v's cache rows), for even head sizes.
  void RopeQKStoreKv(float* q, int64_t q_stride, int q_heads, float* k, const float* v,
                     int64_t kv_stride, int kv_heads, int n, int head_dim, const int32_t* positions,
                     const RopeSpec& rope, const int64_t* dst_rows, void* k_cache, void* v_cache,
                     int64_t cache_stride, KvDtype cache_dtype) override;
  void StoreKv(const float* k, const float* v, int n, int64_t src_stride, int64_t row_elems,
               const int64_t* dst_rows, void* k_cache, void* v_cache, int64_t cache_stride,
               KvDtype cache_dtype) override;
  absl::Status Attention(const AttentionArgs<float>& args) override;
  // Every call's host-side checks first (nothing runs if one fails). Then runs of
  // consecutive calls that take the same kernel (paged, causal, no maps or documents, one
  // cache and shape, q and out rows following on in one buffer) go out as one launch:
  // decode-like calls as one split-KV launch, prefill chunks as one flash launch over all
  // their 64-query tiles; the rest run one by one.
  absl::Status AttentionBatch(absl::Span<const AttentionArgs<float>> calls, int* failed) override;
  // The attention backward (kernels/attention_backward.h), fp32: q, the KV cache, probs,
  // dout and every result are device memory; block table and document ids are host
  // arrays, as for Attention. Same argument errors as the reference's AttentionBackward,
  // returned without poisoning the backend.
  absl::Status AttentionBackward(const AttentionBackwardArgs<float>& args) override;
  // dx += dy · W on device pointers (cuBLAS, beta = 1). As in MatMul, f16/bf16 (and
  // block types → f16) weights take dy rounded to their dtype, fp32 accumulation.
  absl::Status MatMulBackwardInput(const float* dy, int n, const WeightView& w, float* dx) override;
  // One launch (LaunchDrawTokens, every row, greedy ones too), the draws, their logit
  // biases and their penalties' token counts uploaded with the index arrays, and one copy
  // of 8 bytes a row back (168 with top log-probabilities); vocabularies past
  // kDrawMaxVocab go to Backend's host default. A bias or counted id outside the
  // vocabulary, or a count below 1, is INVALID_ARGUMENT. Not while a step is recorded
  // (FAILED_PRECONDITION).
  absl::Status DrawTokens(const float* logits, int rows, int vocab, const TokenDraw* draws,
                          int32_t* token, float* logprob, int32_t* top_token,
                          float* top_logprob) override;

 private:
  CudaBackend(int device, int num_sms, cudaStream_t stream, cublasContext* cublas);

  // Keeps the first failure; true when s is OK and no earlier op failed.
  bool Ok(const absl::Status& s);
  // fn(args..., stream_) now, or recorded when a step is (StepGraph::Run). Every launch of
  // the backend goes through here.
  template <typename Fn, typename... Args>
  absl::Status Launch(Fn* fn, const Args&... args) {
    return graph_.Run(stream_, fn, args...);
  }
  // buffer.Reserve(bytes); while a step is recorded, a buffer that must grow is kept alive
  // (retired_) until the next step, as recorded launches still point into it.
  absl::Status ReserveScratch(DeviceBuffer& buffer, size_t bytes);
  absl::StatusOr<const DeviceWeight*> Upload(const WeightView& w);
  // rope with its frequency factors (host) replaced by their device copy, uploaded once
  // as a weight.
  absl::StatusOr<RopeSpec> DeviceRope(const RopeSpec& rope, int head_dim);
  // Copies `bytes` of host memory to the device, ordered on stream_. The device copy is
  // valid for work enqueued before the next upload that wraps or grows the ring, so an op
  // makes at most one upload. Bytes equal to one of the last kIndexReuse uploads since
  // the ring last wrapped reuse that copy: its staged bytes are still in the ring, and its
  // copy is ordered before any later reader (the engine's layers repeat the step's
  // positions, cache rows and block tables). Only an upload from the same host array is
  // reused: which uploads a step reuses then does not depend on whether, say, a token id
  // happens to equal a position, so the step's launches (and its graph) stay the same.
  absl::StatusOr<const void*> UploadIndices(const void* host, size_t bytes);
  // Several index arrays of one op in its one upload: each copied into `pack` (the op's
  // own staging array, so that a copy is reused only by the same op) at a 16-byte aligned
  // offset, and device[i] set to arrays[i]'s copy (null for an empty array).
  struct HostArray {
    const void* data;
    size_t bytes;
  };
  absl::Status UploadPacked(std::vector<unsigned char>& pack,
                            std::initializer_list<HostArray> arrays, const void** device);
  // The GEMM operand for x [count] against a `dtype` weight: x itself for f32, else x
  // rounded to f16/bf16 in gemm_input_ (valid until the next call).
  absl::StatusOr<const void*> GemmOperand(const float* x, int64_t count, DType dtype);
  // y[n, W.rows] = operand · Wᵀ (+ B) by cuBLAS, added to y with `accumulate`; operand:
  // GemmOperand of x for W's dtype.
  absl::Status Gemm(const void* operand, int n, const DeviceWeight& W, const DeviceWeight* B,
                    float* y, bool accumulate = false);
  // y = x · wᵀ + bias, then gelu_tanh with `gelu` (in the matvec's epilogue, else a Gelu
  // launch after the GEMM); added into y with `accumulate` (not with gelu).
  absl::Status MatMulImpl(const float* x, int n, const WeightView& w, const WeightView& bias,
                          float* y, bool gelu = false, bool accumulate = false);
  // An RMSNorm of a product's x (RmsNormMatMul*): into the matvec where `fits`, else
  // launched into xn first.
  struct PreNorm {
    int dim;
    const WeightView& weight;
    double eps;
    float* xn;
  };
  // The MatVecNorm for `norm` when a matvec launch (`matvec`) of n rows of width `in`
  // takes it (its weight uploaded). Else the norm runs first, on *x into norm->xn, which
  // becomes the products' *x, and the products get MatVecNorm{} (none), as for no norm.
  absl::StatusOr<MatVecNorm> MatVecNormFor(const PreNorm* norm, int n, int64_t in, bool matvec,
                                           const float** x);
  // MatMulMany, RmsNormMatMulMany (with a norm), RmsNormQkvRopeStoreKv (with kv too),
  // MatMulQkvRopeStoreKv (kv alone).
  void MatMulManyImpl(const float* x, int n, absl::Span<const MatMulOutput<float>> outputs,
                      const PreNorm* norm, const QkvRopeStore* kv = nullptr);
  // MatMulSwiGlu (kSilu) and MatMulGeGlu (kGeluTanh), RmsNormMatMul*Glu with a norm.
  void MatMulGated(const float* x, int n, const WeightView& w_gate, const WeightView& w_up,
                   GateActivation gate, float* up_scratch, float* out,
                   const PreNorm* norm = nullptr);
  absl::Status AttentionImpl(const AttentionArgs<float>& a);  // checks + AttentionChecked
  // A call whose checks passed: uploads its index arrays and launches the right kernel.
  absl::Status AttentionChecked(const AttentionArgs<float>& a);
  // The split-KV kernels for p, with their workspace.
  // imbalance: a batched launch's SplitKvImbalance where kernels_.split_kv_balanced, else 1.
  absl::Status SplitKv(const AttentionParams& p, int imbalance = 1);
  absl::Status AttentionBackwardImpl(const AttentionBackwardArgs<float>& b);
  // One launch for calls (checked, of one BatchKind, q/out rows consecutive): split-KV
  // with per-row key ends, or flash with per-block tiles of the sequences.
  absl::Status LaunchSplitKvBatched(absl::Span<const AttentionArgs<float>> calls);
  absl::Status LaunchFlashBatched(absl::Span<const AttentionArgs<float>> calls);
  // One launch for materialised calls of one query row each (checked; one kv dtype and
  // head count; no documents): the engine's last-query reruns.
  absl::Status LaunchMaterializedRowsBatched(absl::Span<const AttentionArgs<float>> calls);
  // kernels_.flash_layout with one field set, if SetFlashLayout takes it.
  absl::Status SetFlashLayoutField(int FlashBf16Layout::*field, int value);
  // Whether p's flash launch takes the bf16 kernel (it applies, and flash_bf16_) or, over an
  // fp32 cache, its loop on an fp16 copy (kernels_.flash_f16_copy), the queries of its
  // tiles, and the launch: the bf16 kernel, the fp16 copy's or the fp16 kernel.
  bool TakesFlashBf16(const AttentionParams& p) const;
  bool TakesFlashF16Copy(const AttentionParams& p) const;
  int FlashTile(const AttentionParams& p) const;
  // kv_keys: the keys of a head's sequences, which the head group sized to the L2 cache
  // counts (FlashHeadGroup). on_f16_copy: p's K and V are CopyKvF16's copies.
  absl::Status Flash(AttentionParams p, int64_t kv_keys, bool on_f16_copy = false);
  // Grows kv_f16_ for `copies` blocks of block_size rows of p's K and V: true, or false
  // where that did not fit in device memory (counted in flash_f16_copy_fallbacks_); other
  // failures are errors.
  absl::StatusOr<bool> ReserveKvF16(const AttentionParams& p, int copies, int block_size);
  // Copies p's fp32 cache rows to fp16 in kv_f16_ (reserved for them) and points p at the
  // copies: `copies` blocks of block_size rows, copy c of cache block d_sources[c]
  // (uploaded), or where d_sources is null of a contiguous cache's rows c·block_size …
  // (src_rows of them).
  absl::Status CopyKvF16(AttentionParams& p, const int32_t* d_sources, int copies, int block_size,
                         int64_t src_rows);
  // A single call's flash launch on an fp16 copy (TakesFlashF16Copy).
  absl::Status FlashOnF16Copy(const AttentionArgs<float>& a);
  // The kernels' parameters for a checked forward call, index arrays uploaded, in one upload
  // with `extra` (at *d_extra on the device, where not empty).
  absl::StatusOr<AttentionParams> DeviceParams(const AttentionArgs<float>& a,
                                               absl::Span<const int32_t> extra = {},
                                               const int32_t** d_extra = nullptr);

  int device_ = 0;
  int num_sms_ = 0;
  int64_t l2_bytes_ = 0;  // the device's L2 cache (FlashHeadGroup)
  std::string name_;
  std::string device_name_;
  cudaStream_t stream_ = nullptr;
  CudaMemory memory_;
  cublasContext* cublas_ = nullptr;
  absl::Status status_;

  std::shared_ptr<WeightCache> weights_ = std::make_shared<WeightCache>();

  PinnedBuffer index_host_;    // ring of staged index arrays …
  DeviceBuffer index_device_;  // … and its device mirror (same offsets)
  size_t index_offset_ = 0;
  struct StagedIndices {
    size_t offset, bytes;
    const void* source;  // the host array it was copied from
  };
  std::vector<StagedIndices> index_recent_;  // newest last, at most kIndexReuse
  // While a step is recorded: the rings it filled and left (a ring that grew), each
  // copied whole with the current one at EndStep.
  struct RecordedStage {
    void* device;
    const unsigned char* host;
    size_t bytes;
  };
  std::vector<RecordedStage> recorded_stages_;
  // The current ring's staged bytes so far, [0, index_offset_), into recorded_stages_.
  void KeepRecordedStage();
  IndexUploadStats index_stats_;
  bool flash_bf16_ = true;  // SetFlashBf16
  // SetAttentionKernels, and each option's setter (the flash layout's: SetFlashTileQueries,
  // the tiles asked for, for both flash kernels: FlashTile gives a call's;
  // SetFlashWarpQueries, SetFlashStages, SetFlashKeyTile).
  AttentionKernels kernels_;
  int split_kv_splits_ = 0;                            // SetSplitKvSplits; 0: ChooseNumSplits
  int split_kv_blocks_per_sm_[kSplitKvVariants] = {};  // by SplitKvVariant, 0: not asked yet
  int split_kv_mma_blocks_per_sm_[kSplitKvMmaVariants] = {};  // by SplitKvMmaVariant, 0: not yet
  std::vector<int32_t> index_pack_;  // host staging of one Attention call's index arrays
  // RopeQKStoreKv's and RmsNormQkvRopeStoreKv's positions and cache rows
  std::vector<unsigned char> rope_store_pack_;
  std::vector<unsigned char> draw_pack_;      // DrawTokens' draws, biases and counts
  std::vector<unsigned char> add_rows_pack_;  // AddRows' rows and index

  DeviceBuffer gemm_input_;                  // x rounded to f16/bf16 for the tensor cores
  DeviceBuffer attention_workspace_;         // split-KV partials
  DeviceBuffer map_workspace_;               // S, A or dS a materialised call does not take
  DeviceBuffer kv_f16_;                      // CopyKvF16's copies: K's, then V's
  int64_t flash_f16_copy_fallbacks_ = 0;     // ReserveKvF16's misses
  DeviceBuffer split_kv_arrivals_;           // the fused combine's counts, 0 between launches
  DeviceBuffer pick_device_;                 // DrawTokens' tokens and log-probabilities …
  std::vector<int32_t> pick_host_;           // … copied back (a float's bits in the second half)
  std::vector<DeviceDraw> draw_host_;        // DrawTokens' draws, staged for the upload,
  std::vector<DeviceBias> bias_host_;        // their logit biases
  std::vector<DevicePenalty> penalty_host_;  // and their penalties' token counts
  DeviceBuffer draw_adjusted_;  // DrawTokens' biased or penalized rows past kDrawCachedVocab

  bool graphs_enabled_ = true;
  StepGraph graph_;
  // Buffers replaced while a step was recorded, freed when the next one begins.
  std::vector<DeviceBuffer> retired_;
  std::vector<PinnedBuffer> retired_pinned_;
};

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_CUDA_BACKEND_H_
