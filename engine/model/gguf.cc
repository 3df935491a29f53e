#include "engine/model/gguf.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvlens {

static_assert(std::endian::native == std::endian::little,
              "GGUF is little-endian; this reader maps it without byte swapping");

namespace {

// absl here is built with its own string_view type, which StrCat and absl's string hashing
// take; std::string_view converts through this.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint64_t kMaxAlignment = uint64_t{1} << 30;
constexpr uint32_t kMaxDims = 4;

// Smallest encodings, used to reject counts the remaining bytes could never hold before
// anything is allocated from them.
constexpr uint64_t kMinKvBytes = 8 + 4 + 1;              // empty key, type, one byte
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 4 + 8;  // empty name, n_dims 0, type, offset

struct GgmlTypeTraits {
  std::string_view name;
  uint32_t block_size;  // elements per block
  uint32_t type_size;   // bytes per block
};

// Block layouts from ggml's type traits; {"", 0, 0} marks an id we do not know.
GgmlTypeTraits TraitsOf(GgmlType t) {
  switch (t) {
    case GgmlType::kF32:
      return {"f32", 1, 4};
    case GgmlType::kF16:
      return {"f16", 1, 2};
    case GgmlType::kQ4_0:
      return {"q4_0", 32, 18};
    case GgmlType::kQ4_1:
      return {"q4_1", 32, 20};
    case GgmlType::kQ5_0:
      return {"q5_0", 32, 22};
    case GgmlType::kQ5_1:
      return {"q5_1", 32, 24};
    case GgmlType::kQ8_0:
      return {"q8_0", 32, 34};
    case GgmlType::kQ8_1:
      return {"q8_1", 32, 36};
    case GgmlType::kQ2_K:
      return {"q2_K", 256, 84};
    case GgmlType::kQ3_K:
      return {"q3_K", 256, 110};
    case GgmlType::kQ4_K:
      return {"q4_K", 256, 144};
    case GgmlType::kQ5_K:
      return {"q5_K", 256, 176};
    case GgmlType::kQ6_K:
      return {"q6_K", 256, 210};
    case GgmlType::kQ8_K:
      return {"q8_K", 256, 292};
    case GgmlType::kIQ2_XXS:
      return {"iq2_xxs", 256, 66};
    case GgmlType::kIQ2_XS:
      return {"iq2_xs", 256, 74};
    case GgmlType::kIQ3_XXS:
      return {"iq3_xxs", 256, 98};
    case GgmlType::kIQ1_S:
      return {"iq1_s", 256, 50};
    case GgmlType::kIQ4_NL:
      return {"iq4_nl", 32, 18};
    case GgmlType::kIQ3_S:
      return {"iq3_s", 256, 110};
    case GgmlType::kIQ2_S:
      return {"iq2_s", 256, 82};
    case GgmlType::kIQ4_XS:
      return {"iq4_xs", 256, 136};
    case GgmlType::kI8:
      return {"i8", 1, 1};
    case GgmlType::kI16:
      return {"i16", 1, 2};
    case GgmlType::kI32:
      return {"i32", 1, 4};
    case GgmlType::kI64:
      return {"i64", 1, 8};
    case GgmlType::kF64:
      return {"f64", 1, 8};
    case GgmlType::kIQ1_M:
      return {"iq1_m", 256, 56};
    case GgmlType::kBF16:
      return {"bf16", 1, 2};
    case GgmlType::kTQ1_0:
      return {"tq1_0", 256, 54};
    case GgmlType::kTQ2_0:
      return {"tq2_0", 256, 66};
    case GgmlType::kMXFP4:
      return {"mxfp4", 32, 17};
  }
  return {"", 0, 0};
}

// Bytes of one scalar of a fixed-size metadata type; 0 for string, array and unknown ids.
uint64_t ScalarSize(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  return 0;
}

bool IsIntegerType(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Element `i` of an integer scalar/array as a 128-bit-safe pair: the value and whether it
// is a uint64 beyond int64's range (only kUint64 can be).
struct IntValue {
  int64_t value;
  bool above_int64_max;
};
IntValue LoadInt(GgufType t, const uint8_t* base, uint64_t i) {
  switch (t) {
    case GgufType::kUint8:
      return {Load<uint8_t>(base + i), false};
    case GgufType::kInt8:
      return {Load<int8_t>(base + i), false};
    case GgufType::kUint16:
      return {Load<uint16_t>(base + 2 * i), false};
    case GgufType::kInt16:
      return {Load<int16_t>(base + 2 * i), false};
    case GgufType::kUint32:
      return {Load<uint32_t>(base + 4 * i), false};
    case GgufType::kInt32:
      return {Load<int32_t>(base + 4 * i), false};
    case GgufType::kInt64:
      return {Load<int64_t>(base + 8 * i), false};
    case GgufType::kUint64: {
      const uint64_t u = Load<uint64_t>(base + 8 * i);
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return {std::numeric_limits<int64_t>::max(), true};
      }
      return {static_cast<int64_t>(u), false};
    }
    default:
      return {0, false};
  }
}

}  // namespace

std::string_view GgufTypeName(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
      return "uint8";
    case GgufType::kInt8:
      return "int8";
    case GgufType::kUint16:
      return "uint16";
    case GgufType::kInt16:
      return "int16";
    case GgufType::kUint32:
      return "uint32";
    case GgufType::kInt32:
      return "int32";
    case GgufType::kFloat32:
      return "float32";
    case GgufType::kBool:
      return "bool";
    case GgufType::kString:
      return "string";
    case GgufType::kArray:
      return "array";
    case GgufType::kUint64:
      return "uint64";
    case GgufType::kInt64:
      return "int64";
    case GgufType::kFloat64:
      return "float64";
  }
  return "unknown";
}

std::string_view GgmlTypeName(GgmlType t) {
  const GgmlTypeTraits traits = TraitsOf(t);
  return traits.block_size == 0 ? std::string_view("unknown") : traits.name;
}

int64_t GgufTensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// A bounds-checked cursor over the mapping. Every read names what it was reading so a
// truncated file says where it broke.
class GgufParser {
 public:
  explicit GgufParser(GgufFile& out)
      : out_(out), base_(out.file_->data()), size_(out.file_->size()) {}

  absl::Status Run() {
    uint32_t magic = 0;
    if (auto s = ReadU32("magic", magic); !s.ok()) return s;
    if (magic != kGgufMagic) {
      return Invalid(absl::StrCat("bad magic 0x", absl::Hex(magic, absl::kZeroPad8),
                                  " (want \"GGUF\"): not a GGUF file"));
    }
    if (auto s = ReadU32("version", out_.version_); !s.ok()) return s;
    if (out_.version_ != 2 && out_.version_ != 3) {
      return absl::UnimplementedError(
          absl::StrCat(path(), ": unsupported GGUF version ", out_.version_, " (supported: 2, 3)"));
    }
    uint64_t n_tensors = 0;
    uint64_t n_kv = 0;
    if (auto s = ReadU64("n_tensors", n_tensors); !s.ok()) return s;
    if (auto s = ReadU64("n_kv", n_kv); !s.ok()) return s;
    if (n_kv > remaining() / kMinKvBytes) {
      return Invalid(absl::StrCat("n_kv = ", n_kv, " is more than the ", remaining(),
                                  " remaining bytes could hold (truncated file or corrupt count)"));
    }
    // Tensor infos follow the metadata, so their bound is checked again after it.
    if (n_tensors > remaining() / kMinTensorInfoBytes) {
      return Invalid(absl::StrCat("n_tensors = ", n_tensors, " is more than the ", remaining(),
                                  " remaining bytes could hold (truncated file or corrupt count)"));
    }

    out_.keys_.reserve(n_kv);
    for (uint64_t i = 0; i < n_kv; ++i) {
      if (auto s = ReadKv(i); !s.ok()) return s;
    }
    if (auto s = ReadAlignment(); !s.ok()) return s;

    if (n_tensors > remaining() / kMinTensorInfoBytes) {
      return Invalid(
          absl::StrCat("n_tensors = ", n_tensors, " is more than the ", remaining(),
                       " bytes after the metadata could hold (truncated file or corrupt count)"));
    }
    out_.tensors_.reserve(n_tensors);
    for (uint64_t i = 0; i < n_tensors; ++i) {
      if (auto s = ReadTensorInfo(i); !s.ok()) return s;
    }
    return PlaceTensors();
  }

 private:
  const std::string& path() const { return out_.file_->path(); }
  uint64_t remaining() const { return size_ - pos_; }
  absl::Status Invalid(absl::string_view msg) const {
    return absl::InvalidArgumentError(absl::StrCat(path(), ": ", msg));
  }
  absl::Status Truncated(absl::string_view what, uint64_t need) const {
    return Invalid(absl::StrCat("truncated file: ", what, " needs ", need, " bytes at offset ",
                                pos_, " but only ", remaining(), " remain (file size ", size_,
                                ")"));
  }

  absl::Status Need(absl::string_view what, uint64_t n) const {
    return n > remaining() ? Truncated(what, n) : absl::OkStatus();
  }
  absl::Status ReadU32(absl::string_view what, uint32_t& v) {
    if (auto s = Need(what, 4); !s.ok()) return s;
    v = Load<uint32_t>(base_ + pos_);
    pos_ += 4;
    return absl::OkStatus();
  }
  absl::Status ReadU64(absl::string_view what, uint64_t& v) {
    if (auto s = Need(what, 8); !s.ok()) return s;
    v = Load<uint64_t>(base_ + pos_);
    pos_ += 8;
    return absl::OkStatus();
  }
  absl::Status ReadString(absl::string_view what, std::string_view& v) {
    uint64_t len = 0;
    if (auto s = ReadU64(absl::StrCat(what, " length"), len); !s.ok()) return s;
    if (len > remaining()) {
      return Invalid(absl::StrCat("truncated file: ", what, " has length ", len, " at offset ",
                                  pos_ - 8, " but only ", remaining(), " bytes remain"));
    }
    v = std::string_view(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return absl::OkStatus();
  }

  // Reads a value of type `type` (not an array) into `v`.
  absl::Status ReadScalar(absl::string_view what, GgufType type, GgufValue& v) {
    if (type == GgufType::kString) {
      std::string_view s;
      if (auto st = ReadString(what, s); !st.ok()) return st;
      v.strings.push_back(s);
      return absl::OkStatus();
    }
    const uint64_t n = ScalarSize(type);
    if (auto s = Need(what, n); !s.ok()) return s;
    v.data = base_ + pos_;
    pos_ += n;
    return absl::OkStatus();
  }

  absl::Status ReadKv(uint64_t index) {
    std::string_view key;
    if (auto s = ReadString(absl::StrCat("metadata key #", index), key); !s.ok()) return s;
    const std::string what = absl::StrCat("metadata \"", Sv(key), "\"");
    uint32_t raw_type = 0;
    if (auto s = ReadU32(absl::StrCat(what, " type"), raw_type); !s.ok()) return s;
    GgufValue v;
    v.type = static_cast<GgufType>(raw_type);
    if (raw_type > static_cast<uint32_t>(GgufType::kFloat64)) {
      return Invalid(absl::StrCat(what, " has unknown value type ", raw_type));
    }
    if (v.type == GgufType::kArray) {
      if (auto s = ReadArray(what, v); !s.ok()) return s;
    } else if (auto s = ReadScalar(absl::StrCat(what, " value"), v.type, v); !s.ok()) {
      return s;
    }
    std::string owned_key(key);
    if (out_.metadata_.contains(owned_key)) {
      return Invalid(absl::StrCat("duplicate metadata key \"", Sv(key), "\""));
    }
    out_.keys_.push_back(owned_key);
    out_.metadata_.emplace(std::move(owned_key), std::move(v));
    return absl::OkStatus();
  }

  absl::Status ReadArray(const std::string& what, GgufValue& v) {
    uint32_t raw_elem = 0;
    if (auto s = ReadU32(absl::StrCat(what, " array element type"), raw_elem); !s.ok()) {
      return s;
    }
    if (raw_elem > static_cast<uint32_t>(GgufType::kFloat64)) {
      return Invalid(absl::StrCat(what, " has unknown array element type ", raw_elem));
    }
    v.elem_type = static_cast<GgufType>(raw_elem);
    if (v.elem_type == GgufType::kArray) {
      return Invalid(absl::StrCat(what, " is an array of arrays, which is not supported"));
    }
    if (auto s = ReadU64(absl::StrCat(what, " array length"), v.count); !s.ok()) return s;
    const uint64_t min_elem = v.elem_type == GgufType::kString ? 8 : ScalarSize(v.elem_type);
    if (v.count > remaining() / min_elem) {
      return Invalid(absl::StrCat(what, " array length ", v.count, " is more than the ",
                                  remaining(),
                                  " remaining bytes could hold (truncated file or corrupt count)"));
    }
    if (v.elem_type == GgufType::kString) {
      v.strings.reserve(v.count);
      for (uint64_t i = 0; i < v.count; ++i) {
        std::string_view s;
        if (auto st = ReadString(absl::StrCat(what, "[", i, "]"), s); !st.ok()) return st;
        v.strings.push_back(s);
      }
    } else {
      v.data = base_ + pos_;  // the count check above already bounds count × size
      pos_ += v.count * min_elem;
    }
    return absl::OkStatus();
  }

  absl::Status ReadAlignment() {
    if (out_.Find("general.alignment") == nullptr) return absl::OkStatus();
    auto value = out_.GetUint("general.alignment");
    if (!value.ok()) return absl::InvalidArgumentError(value.status().message());
    if (*value == 0 || (*value & (*value - 1)) != 0 || *value > kMaxAlignment) {
      return Invalid(absl::StrCat("general.alignment = ", *value, " is not a power of two up to ",
                                  kMaxAlignment));
    }
    out_.alignment_ = *value;
    return absl::OkStatus();
  }

  absl::Status ReadTensorInfo(uint64_t index) {
    std::string_view name;
    if (auto s = ReadString(absl::StrCat("tensor #", index, " name"), name); !s.ok()) return s;
    const std::string what = absl::StrCat("tensor \"", Sv(name), "\"");
    GgufTensor t;
    t.name = std::string(name);
    uint32_t n_dims = 0;
    if (auto s = ReadU32(absl::StrCat(what, " n_dims"), n_dims); !s.ok()) return s;
    if (n_dims > kMaxDims) {
      return Invalid(absl::StrCat(what, " has n_dims = ", n_dims, " (at most ", kMaxDims, ")"));
    }
    uint64_t ne[kMaxDims] = {1, 1, 1, 1};
    for (uint32_t d = 0; d < n_dims; ++d) {
      if (auto s = ReadU64(absl::StrCat(what, " ne[", d, "]"), ne[d]); !s.ok()) return s;
      if (ne[d] == 0 || ne[d] > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Invalid(absl::StrCat(what, " has dimension ne[", d,
                                    "] = ", static_cast<int64_t>(ne[d]), " (must be positive)"));
      }
    }
    uint32_t raw_type = 0;
    if (auto s = ReadU32(absl::StrCat(what, " type"), raw_type); !s.ok()) return s;
    t.type = static_cast<GgmlType>(raw_type);
    const GgmlTypeTraits traits = TraitsOf(t.type);
    if (traits.block_size == 0) {
      return Invalid(absl::StrCat(what, " has unknown ggml type ", raw_type));
    }
    if (auto s = ReadU64(absl::StrCat(what, " offset"), t.offset); !s.ok()) return s;

    if (ne[0] % traits.block_size != 0) {
      return Invalid(absl::StrCat(what, " has ne[0] = ", ne[0], ", not a multiple of the ",
                                  Sv(traits.name), " block size ", traits.block_size));
    }
    // Size in bytes, refusing anything that overflows or exceeds the file.
    const uint64_t row_blocks = ne[0] / traits.block_size;
    if (row_blocks > size_ / traits.type_size) {
      return Invalid(absl::StrCat(what, " with shape [", ShapeString(ne, n_dims),
                                  "] is larger than the whole file"));
    }
    uint64_t nbytes = row_blocks * traits.type_size;
    for (uint32_t d = 1; d < n_dims; ++d) {
      if (nbytes > size_ / ne[d]) {
        return Invalid(absl::StrCat(what, " with shape [", ShapeString(ne, n_dims),
                                    "] is larger than the whole file"));
      }
      nbytes *= ne[d];
    }
    t.nbytes = nbytes;
    for (uint32_t d = n_dims; d-- > 0;) t.shape.push_back(static_cast<int64_t>(ne[d]));

    if (out_.tensor_index_.contains(t.name)) {
      return Invalid(absl::StrCat("duplicate tensor name \"", Sv(name), "\""));
    }
    out_.tensor_index_.emplace(t.name, out_.tensors_.size());
    out_.tensors_.push_back(std::move(t));
    return absl::OkStatus();
  }

  static std::string ShapeString(const uint64_t* ne, uint32_t n_dims) {
    std::vector<uint64_t> dims(ne, ne + n_dims);
    return absl::StrJoin(dims, ", ");
  }

  // The data section starts at the next aligned offset; every tensor must be aligned,
  // inside the file and disjoint from the others.
  absl::Status PlaceTensors() {
    const uint64_t align = out_.alignment_;
    const uint64_t data_start = (pos_ + align - 1) / align * align;
    if (data_start > size_ && !out_.tensors_.empty()) {
      return Invalid(absl::StrCat("truncated file: tensor data section would start at ", data_start,
                                  " beyond the file size ", size_));
    }
    const uint64_t data_size = data_start > size_ ? 0 : size_ - data_start;
    std::vector<const GgufTensor*> by_offset;
    by_offset.reserve(out_.tensors_.size());
    for (GgufTensor& t : out_.tensors_) {
      if (t.offset % align != 0) {
        return Invalid(absl::StrCat("tensor \"", t.name, "\" offset ", t.offset,
                                    " is not aligned to general.alignment = ", align));
      }
      if (t.offset > data_size || t.nbytes > data_size - t.offset) {
        return Invalid(absl::StrCat(
            "truncated file: tensor \"", t.name, "\" data [", t.offset, ", ", t.offset + t.nbytes,
            ") runs past the end of the data section (", data_size, " bytes)"));
      }
      t.data = base_ + data_start + t.offset;
      by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensor& prev = *by_offset[i - 1];
      const GgufTensor& cur = *by_offset[i];
      if (prev.offset + prev.nbytes > cur.offset) {
        return Invalid(absl::StrCat("tensor \"", cur.name, "\" data at offset ", cur.offset,
                                    " overlaps tensor \"", prev.name, "\" [", prev.offset, ", ",
                                    prev.offset + prev.nbytes, ")"));
      }
    }
    return absl::OkStatus();
  }

  GgufFile& out_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path) {
  auto file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  return Parse(*std::move(file));
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::shared_ptr<MappedFile> file) {
  std::unique_ptr<GgufFile> out(new GgufFile(std::move(file)));
  GgufParser parser(*out);
  if (auto s = parser.Run(); !s.ok()) return s;
  return out;
}

const GgufValue* GgufFile::Find(std::string_view key) const {
  auto it = metadata_.find(Sv(key));
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

absl::StatusOr<const GgufValue*> Lookup(const GgufFile& f, std::string_view key) {
  const GgufValue* v = f.Find(key);
  if (v == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(f.path(), ": metadata key \"", Sv(key), "\" not found"));
  }
  return v;
}

std::string TypeString(const GgufValue& v) {
  if (v.type != GgufType::kArray) return std::string(Sv(GgufTypeName(v.type)));
  return absl::StrCat("array of ", Sv(GgufTypeName(v.elem_type)));
}

absl::Status WrongType(const GgufFile& f, std::string_view key, const GgufValue& v,
                       std::string_view want) {
  return absl::InvalidArgumentError(absl::StrCat(f.path(), ": metadata \"", Sv(key), "\" is ",
                                                 TypeString(v), ", expected ", Sv(want)));
}

}  // namespace

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if (!IsIntegerType((*v)->type)) return WrongType(*this, key, **v, "an integer");
  const IntValue iv = LoadInt((*v)->type, (*v)->data, 0);
  if (iv.above_int64_max) {
    return absl::OutOfRangeError(
        absl::StrCat(path(), ": metadata \"", Sv(key), "\" does not fit in int64"));
  }
  return iv.value;
}

absl::StatusOr<uint64_t> GgufFile::GetUint(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if (!IsIntegerType((*v)->type)) return WrongType(*this, key, **v, "an integer");
  if ((*v)->type == GgufType::kUint64) return Load<uint64_t>((*v)->data);
  const int64_t value = LoadInt((*v)->type, (*v)->data, 0).value;
  if (value < 0) {
    return absl::OutOfRangeError(
        absl::StrCat(path(), ": metadata \"", Sv(key), "\" = ", value, " is negative"));
  }
  return static_cast<uint64_t>(value);
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if ((*v)->type == GgufType::kFloat32) return Load<float>((*v)->data);
  if ((*v)->type == GgufType::kFloat64) return Load<double>((*v)->data);
  return WrongType(*this, key, **v, "float32 or float64");
}

absl::StatusOr<std::string_view> GgufFile::GetString(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if ((*v)->type != GgufType::kString) return WrongType(*this, key, **v, "string");
  return (*v)->strings[0];
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if ((*v)->type != GgufType::kBool) return WrongType(*this, key, **v, "bool");
  return (*v)->data[0] != 0;
}

absl::StatusOr<absl::Span<const std::string_view>> GgufFile::GetStringArray(
    std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  if ((*v)->type != GgufType::kArray || (*v)->elem_type != GgufType::kString) {
    return WrongType(*this, key, **v, "array of string");
  }
  return absl::MakeConstSpan((*v)->strings);
}

absl::StatusOr<std::vector<float>> GgufFile::GetFloatArray(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  const GgufValue& value = **v;
  const bool f32 = value.elem_type == GgufType::kFloat32;
  if (value.type != GgufType::kArray || (!f32 && value.elem_type != GgufType::kFloat64)) {
    return WrongType(*this, key, value, "array of float32 or float64");
  }
  std::vector<float> out(value.count);
  for (uint64_t i = 0; i < value.count; ++i) {
    out[i] = f32 ? Load<float>(value.data + 4 * i)
                 : static_cast<float>(Load<double>(value.data + 8 * i));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  auto v = Lookup(*this, key);
  if (!v.ok()) return v.status();
  const GgufValue& value = **v;
  if (value.type != GgufType::kArray || !IsIntegerType(value.elem_type)) {
    return WrongType(*this, key, value, "array of integers");
  }
  std::vector<int64_t> out(value.count);
  for (uint64_t i = 0; i < value.count; ++i) {
    const IntValue iv = LoadInt(value.elem_type, value.data, i);
    if (iv.above_int64_max) {
      return absl::OutOfRangeError(
          absl::StrCat(path(), ": metadata \"", Sv(key), "\"[", i, "] does not fit in int64"));
    }
    out[i] = iv.value;
  }
  return out;
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(Sv(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

absl::StatusOr<kernels::WeightView> GgufWeightView(const GgufTensor& tensor) {
  kernels::DType dtype;
  switch (tensor.type) {
    case GgmlType::kF32:
      dtype = kernels::DType::kF32;
      break;
    case GgmlType::kF16:
      dtype = kernels::DType::kF16;
      break;
    case GgmlType::kBF16:
      dtype = kernels::DType::kBF16;
      break;
    case GgmlType::kQ8_0:
      dtype = kernels::DType::kQ8_0;
      break;
    case GgmlType::kQ4_0:
      dtype = kernels::DType::kQ4_0;
      break;
    case GgmlType::kQ4_1:
      dtype = kernels::DType::kQ4_1;
      break;
    case GgmlType::kQ5_0:
      dtype = kernels::DType::kQ5_0;
      break;
    case GgmlType::kQ5_1:
      dtype = kernels::DType::kQ5_1;
      break;
    case GgmlType::kQ2_K:
      dtype = kernels::DType::kQ2_K;
      break;
    case GgmlType::kQ3_K:
      dtype = kernels::DType::kQ3_K;
      break;
    case GgmlType::kQ4_K:
      dtype = kernels::DType::kQ4_K;
      break;
    case GgmlType::kQ5_K:
      dtype = kernels::DType::kQ5_K;
      break;
    case GgmlType::kQ6_K:
      dtype = kernels::DType::kQ6_K;
      break;
    case GgmlType::kIQ4_NL:
      dtype = kernels::DType::kIQ4_NL;
      break;
    case GgmlType::kIQ4_XS:
      dtype = kernels::DType::kIQ4_XS;
      break;
    default:
      return absl::UnimplementedError(absl::StrCat(
          "tensor \"", tensor.name, "\" has ggml type ", Sv(GgmlTypeName(tensor.type)), " (",
          static_cast<uint32_t>(tensor.type),
          "); supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, "
          "q5_K, q6_K, iq4_nl, iq4_xs"));
  }
  // ne[0] is the last entry of the row-major shape; a 0-d tensor is a single element.
  const int64_t cols = tensor.shape.empty() ? 1 : tensor.shape.back();
  return kernels::WeightView{tensor.data, dtype, tensor.num_elements() / cols, cols};
}

}  // namespace kvlens
