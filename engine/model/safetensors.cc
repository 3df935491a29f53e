#include "engine/model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvlens {
namespace {

using nlohmann::json;

// Element size of every dtype the format defines (0: unknown).
int DTypeBytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

constexpr uint64_t kMaxHeaderBytes = 100 << 20;  // as the reference implementation

}  // namespace

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  auto mapped = MappedFile::Open(path);
  if (!mapped.ok()) return mapped.status();
  auto st = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  st->file_ = *std::move(mapped);
  const uint8_t* base = st->file_->data();
  const uint64_t size = st->file_->size();
  auto bad = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors ", path, ": ", what));
  };
  if (size < 8) return bad(absl::StrCat("truncated: ", size, " bytes, the header size needs 8"));
  uint64_t header_size;
  std::memcpy(&header_size, base, 8);
  if (header_size > kMaxHeaderBytes || header_size > size - 8) {
    return bad(absl::StrCat("header size ", header_size, " exceeds the file (", size,
                            " bytes) or the limit ", kMaxHeaderBytes));
  }
  json header;
  try {
    header = json::parse(base + 8, base + 8 + header_size);
  } catch (const json::exception& e) {
    return bad(absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) return bad("header is not a JSON object");
  const uint8_t* data = base + 8 + header_size;
  const uint64_t data_size = size - 8 - header_size;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<std::string> range_names;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) return bad("__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          return bad(absl::StrCat("__metadata__.", m.key(), " is not a string"));
        st->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor ", name);
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets")) {
      return bad(absl::StrCat(where, ": needs dtype, shape and data_offsets"));
    }
    SafetensorsTensor t;
    t.name = name;
    if (!v["dtype"].is_string()) return bad(absl::StrCat(where, ": dtype is not a string"));
    t.dtype = v["dtype"].get<std::string>();
    const int elem = DTypeBytes(t.dtype);
    if (elem == 0) return bad(absl::StrCat(where, ": unknown dtype ", t.dtype));
    if (!v["shape"].is_array() || v["shape"].size() > 8) {
      return bad(absl::StrCat(where, ": shape must be an array of at most 8 dimensions"));
    }
    uint64_t count = 1;
    for (const json& d : v["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t{1} << 40)) {
        return bad(absl::StrCat(where, ": shape has an invalid dimension ", d.dump()));
      }
      t.shape.push_back(d.get<int64_t>());
      const uint64_t dim = static_cast<uint64_t>(t.shape.back());
      // count · dim > data_size, asked without the product (which could wrap around)
      if (dim != 0 && count > data_size / dim) {
        return bad(absl::StrCat(where, ": shape is larger than the file (data section of ",
                                data_size, " bytes)"));
      }
      count *= dim;
    }
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
        !off[1].is_number_unsigned()) {
      return bad(absl::StrCat(where, ": data_offsets must be two non-negative integers"));
    }
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size) {
      return bad(absl::StrCat(where, ": data_offsets [", b, ", ", e,
                              ") outside the data section of ", data_size,
                              " bytes (truncated file?)"));
    }
    if (e - b != count * elem) {
      return bad(absl::StrCat(where, ": ", e - b, " bytes, but dtype ", t.dtype, " and shape need ",
                              count * elem));
    }
    t.data = data + b;
    t.nbytes = e - b;
    ranges.emplace_back(b, e);
    range_names.push_back(name);
    st->tensors_.emplace(name, std::move(t));
  }
  // No two tensors may share bytes. Sorted by begin, each non-empty range must start at or
  // after the furthest end so far (not just its neighbour's: an empty range may sit between
  // two that overlap).
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a] < ranges[b]; });
  std::optional<size_t> furthest;  // the non-empty range seen so far that ends last
  for (size_t i : order) {
    const auto& cur = ranges[i];
    if (cur.first == cur.second) continue;
    if (furthest && cur.first < ranges[*furthest].second) {
      return bad(
          absl::StrCat("tensors ", range_names[*furthest], " and ", range_names[i], " overlap"));
    }
    if (!furthest || cur.second > ranges[*furthest].second) furthest = i;
  }
  return st;
}

absl::StatusOr<kernels::WeightView> SafetensorsWeightView(const SafetensorsTensor& t) {
  kernels::WeightView w;
  if (t.dtype == "F32") {
    w.dtype = kernels::DType::kF32;
  } else if (t.dtype == "F16") {
    w.dtype = kernels::DType::kF16;
  } else if (t.dtype == "BF16") {
    w.dtype = kernels::DType::kBF16;
  } else {
    return absl::UnimplementedError(
        absl::StrCat("tensor ", t.name, ": dtype ", t.dtype, " is not supported (F32, F16, BF16)"));
  }
  if (t.shape.empty() || t.shape.size() > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", t.name, ": ", t.shape.size(), "-D, expected a vector or a matrix"));
  }
  w.data = t.data;
  w.cols = t.shape.back();
  w.rows = t.shape.size() == 2 ? t.shape[0] : 1;
  return w;
}

}  // namespace kvlens
