// safetensors (Hugging Face's tensor file format) over a memory-mapped file.
//
//   u64 header_size (little-endian)
//   header: JSON object { "name": {"dtype": "F32", "shape": [r, c], "data_offsets": [b, e]},
//                         …, "__metadata__": {string: string} }
//   data: byte buffer; a tensor's bytes are data[b, e), row-major
//
// Open() validates the whole header up front: the JSON parses, every dtype is known,
// offsets lie inside the data section, sizes agree with dtype × shape, no two tensors
// overlap.
#ifndef KVLENS_ENGINE_MODEL_SAFETENSORS_H_
#define KVLENS_ENGINE_MODEL_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/mapped_file.h"
#include "kernels/weight.h"

namespace kvlens {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;           // "F32", "F16", "BF16", … as written
  std::vector<int64_t> shape;  // row-major, outermost first
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
};

class SafetensorsFile {
 public:
  // NOT_FOUND for a missing file; INVALID_ARGUMENT naming the file and field otherwise.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);

  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const SafetensorsTensor* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::shared_ptr<MappedFile> file() const { return file_; }
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The tensor as a [rows, cols] view (cols = last dimension; a 1-D tensor is [1, n]).
// F32, F16 and BF16 only: UNIMPLEMENTED naming the tensor for other dtypes.
absl::StatusOr<kernels::WeightView> SafetensorsWeightView(const SafetensorsTensor& t);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_SAFETENSORS_H_
