// GGUF (llama.cpp's model format, versions 2 and 3) over a memory-mapped file.
//
// File layout (all little-endian):
//
//   "GGUF" u32 version u64 n_tensors u64 n_kv
//   n_kv × { string key, u32 value_type, value }           metadata
//   n_tensors × { string name, u32 n_dims, u64 ne[n_dims],  tensor infos
//                 u32 ggml_type, u64 offset }
//   padding to general.alignment (default 32)
//   tensor data; each tensor at data_start + offset (offset aligned)
//
// string = u64 length + bytes (no terminator); array = u32 elem_type, u64 count, elems.
// Open() validates everything up front (bounds, counts, alignment, overlaps), so every
// pointer it hands out stays inside the mapping.
#ifndef KVLENS_ENGINE_MODEL_GGUF_H_
#define KVLENS_ENGINE_MODEL_GGUF_H_

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model/mapped_file.h"
#include "kernels/weight.h"

namespace kvlens {

// Metadata value types, numbered as in the file.
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};
std::string_view GgufTypeName(GgufType t);

// ggml tensor element types, numbered as in ggml.h (gaps are removed types).
enum class GgmlType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
  kMXFP4 = 39,
};
// "f32", "q8_0", …; "unknown" for ids not in the enum.
std::string_view GgmlTypeName(GgmlType t);

// One metadata value. Scalars and numeric arrays point at their raw little-endian bytes
// inside the mapping; strings (and string arrays) are views into the mapping.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  GgufType elem_type = GgufType::kUint8;  // arrays only
  uint64_t count = 1;                     // arrays: element count; scalars: 1
  const uint8_t* data = nullptr;          // scalars and numeric arrays: first element
  std::vector<std::string_view> strings;  // kString: one element; string arrays: all
};

struct GgufTensor {
  std::string name;
  std::vector<int64_t> shape;  // row-major, outermost first (ggml's ne reversed)
  GgmlType type = GgmlType::kF32;
  uint64_t offset = 0;            // from the start of the data section
  const uint8_t* data = nullptr;  // into the mapping
  uint64_t nbytes = 0;

  int64_t num_elements() const;
};

class GgufFile {
 public:
  // NOT_FOUND for a missing file; INVALID_ARGUMENT naming the field for any malformed
  // content; UNIMPLEMENTED for a version other than 2 or 3.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path);
  // Parses an existing mapping (the file object is kept alive by the result).
  static absl::StatusOr<std::unique_ptr<GgufFile>> Parse(std::shared_ptr<MappedFile> file);

  uint32_t version() const { return version_; }
  const std::string& path() const { return file_->path(); }
  std::shared_ptr<MappedFile> file() const { return file_; }

  // Metadata. Find returns nullptr when absent. The getters return NOT_FOUND for a missing
  // key and INVALID_ARGUMENT naming the key and its actual type for a type mismatch.
  const GgufValue* Find(std::string_view key) const;
  const std::vector<std::string>& keys() const { return keys_; }  // in file order
  absl::StatusOr<uint64_t> GetUint(std::string_view key) const;   // any integer type, ≥ 0
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;     // any integer type
  absl::StatusOr<double> GetFloat(std::string_view key) const;    // f32 or f64
  absl::StatusOr<std::string_view> GetString(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  absl::StatusOr<absl::Span<const std::string_view>> GetStringArray(std::string_view key) const;
  absl::StatusOr<std::vector<float>> GetFloatArray(std::string_view key) const;  // f32/f64
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;  // any int

  // Tensors, in file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* FindTensor(std::string_view name) const;
  uint64_t alignment() const { return alignment_; }

 private:
  explicit GgufFile(std::shared_ptr<MappedFile> file) : file_(std::move(file)) {}
  friend class GgufParser;

  std::shared_ptr<MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::vector<std::string> keys_;
  absl::flat_hash_map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  absl::flat_hash_map<std::string, size_t> tensor_index_;
};

// The tensor as a 2-D weight view [rows, cols]: cols = ne[0] (the innermost, contiguous
// dimension), rows = product of the outer dimensions. F32, F16, BF16 and the block types
// kvlens decodes (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K … Q6_K, IQ4_NL, IQ4_XS); other types
// (the other i-quants, ternary, integer) give UNIMPLEMENTED naming the tensor, its type and the
// supported ones.
absl::StatusOr<kernels::WeightView> GgufWeightView(const GgufTensor& tensor);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_GGUF_H_
