// NumPy's .npz (np.savez: a zip archive of .npy files, stored uncompressed) over a
// memory-mapped file, as Gemma Scope ships its SAEs (params.npz).
//
//   zip: local headers + data …, central directory, [zip64 end record + locator], end record
//   .npy: "\x93NUMPY", major, minor, header length (u16; u32 from version 2), a Python dict
//         literal {'descr': '<f4', 'fortran_order': False, 'shape': (r, c), }, padding, data
//
// Open() reads the central directory and every array's header up front and checks that each
// array's bytes lie inside the file and agree with its dtype × shape. Compressed members
// (np.savez_compressed) are refused by name: their bytes are not the array.
#ifndef KVLENS_ENGINE_MODEL_NPZ_H_
#define KVLENS_ENGINE_MODEL_NPZ_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/mapped_file.h"

namespace kvlens {

struct NpzArray {
  std::string name;            // the member's name without ".npy"
  std::string descr;           // "<f4", "<f2", "<f8", …
  std::vector<int64_t> shape;  // C order
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
};

class NpzFile {
 public:
  // NOT_FOUND for a missing file; INVALID_ARGUMENT naming the file (and member) otherwise.
  static absl::StatusOr<std::unique_ptr<NpzFile>> Open(const std::string& path);

  const std::map<std::string, NpzArray>& arrays() const { return arrays_; }
  const NpzArray* Find(const std::string& name) const;
  const std::string& path() const { return file_->path(); }

 private:
  std::shared_ptr<MappedFile> file_;
  std::map<std::string, NpzArray> arrays_;
};

// The elements of a float array ("<f2", "<f4", "<f8") as floats; INVALID_ARGUMENT naming
// the array for any other dtype.
absl::StatusOr<std::vector<float>> NpzFloats(const NpzArray& a);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_NPZ_H_
