// A tiny GGUF writer for tests: builds valid files field by field, and lets a test bend any
// field (counts, offsets, types) to produce exactly the malformed file it wants.
#ifndef KVLENS_TESTS_ENGINE_MODEL_GGUF_TEST_WRITER_H_
#define KVLENS_TESTS_ENGINE_MODEL_GGUF_TEST_WRITER_H_

#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "tests/temp_dir.h"

namespace kvlens::testing {

// Little-endian encoders for the writer and for hand-made raw values.
template <typename T>
std::string Le(T v) {
  std::string s(sizeof(T), '\0');
  std::memcpy(s.data(), &v, sizeof(T));
  return s;
}
inline std::string GgufStr(const std::string& s) { return Le<uint64_t>(s.size()) + s; }

// Metadata value type ids, as in the file.
enum : uint32_t {
  kGU8 = 0,
  kGI8 = 1,
  kGU16 = 2,
  kGI16 = 3,
  kGU32 = 4,
  kGI32 = 5,
  kGF32 = 6,
  kGBool = 7,
  kGString = 8,
  kGArray = 9,
  kGU64 = 10,
  kGI64 = 11,
  kGF64 = 12,
};

class GgufWriter {
 public:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;  // ggml order: ne[0] innermost
    uint32_t type = 0;         // ggml type id (0 = f32)
    std::string data;
    std::optional<uint64_t> offset;  // default: next aligned offset after the previous tensor
  };

  uint32_t magic = 0x46554747;
  uint32_t version = 3;
  std::optional<uint64_t> n_tensors_override;
  std::optional<uint64_t> n_kv_override;
  uint64_t alignment = 32;  // the padding this writer uses (set general.alignment to match)
  std::vector<Tensor> tensors;

  // A key/value whose value bytes are given raw (after the type id).
  void AddRaw(const std::string& key, uint32_t type, const std::string& value_bytes) {
    kvs_.push_back(GgufStr(key) + Le<uint32_t>(type) + value_bytes);
    ++n_kv_;
  }
  void AddU32(const std::string& key, uint32_t v) { AddRaw(key, kGU32, Le(v)); }
  void AddI32(const std::string& key, int32_t v) { AddRaw(key, kGI32, Le(v)); }
  void AddU64(const std::string& key, uint64_t v) { AddRaw(key, kGU64, Le(v)); }
  void AddF32(const std::string& key, float v) { AddRaw(key, kGF32, Le(v)); }
  void AddBool(const std::string& key, bool v) { AddRaw(key, kGBool, std::string(1, v ? 1 : 0)); }
  void AddString(const std::string& key, const std::string& v) {
    AddRaw(key, kGString, GgufStr(v));
  }
  void AddStringArray(const std::string& key, const std::vector<std::string>& v) {
    std::string b = Le<uint32_t>(kGString) + Le<uint64_t>(v.size());
    for (const std::string& s : v) b += GgufStr(s);
    AddRaw(key, kGArray, b);
  }
  void AddF32Array(const std::string& key, const std::vector<float>& v) {
    std::string b = Le<uint32_t>(kGF32) + Le<uint64_t>(v.size());
    for (float f : v) b += Le(f);
    AddRaw(key, kGArray, b);
  }
  void AddI32Array(const std::string& key, const std::vector<int32_t>& v) {
    std::string b = Le<uint32_t>(kGI32) + Le<uint64_t>(v.size());
    for (int32_t x : v) b += Le(x);
    AddRaw(key, kGArray, b);
  }
  void AddF32Tensor(const std::string& name, std::vector<uint64_t> ne) {
    uint64_t n = 1;
    for (uint64_t d : ne) n *= d;
    std::string data;
    for (uint64_t i = 0; i < n; ++i) data += Le(static_cast<float>(i));
    tensors.push_back({name, std::move(ne), 0, std::move(data), std::nullopt});
  }

  std::string Bytes() const {
    std::string out = Le(magic) + Le(version);
    out += Le<uint64_t>(n_tensors_override.value_or(tensors.size()));
    out += Le<uint64_t>(n_kv_override.value_or(n_kv_));
    for (const std::string& kv : kvs_) out += kv;
    std::vector<uint64_t> offsets;
    uint64_t next = 0;
    for (const Tensor& t : tensors) {
      const uint64_t off = t.offset.value_or(next);
      offsets.push_back(off);
      next = Align(off + t.data.size());
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const Tensor& t = tensors[i];
      out += GgufStr(t.name) + Le<uint32_t>(t.ne.size());
      for (uint64_t d : t.ne) out += Le(d);
      out += Le(t.type) + Le(offsets[i]);
    }
    out.resize(Align(out.size()), '\0');
    const size_t data_start = out.size();
    for (size_t i = 0; i < tensors.size(); ++i) {
      const size_t at = data_start + offsets[i];
      if (out.size() < at + tensors[i].data.size()) out.resize(at + tensors[i].data.size(), '\0');
      std::memcpy(out.data() + at, tensors[i].data.data(), tensors[i].data.size());
    }
    return out;
  }

 private:
  uint64_t Align(uint64_t x) const { return (x + alignment - 1) / alignment * alignment; }
  std::vector<std::string> kvs_;
  uint64_t n_kv_ = 0;
};

// EXPECT_TRUE(HasSubstr(message, "field")) without gmock; failure prints both.
inline ::testing::AssertionResult HasSubstr(std::string_view text, std::string_view needle) {
  if (text.find(needle) != std::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "\"" << text << "\" does not contain \"" << needle << "\"";
}

// Writes `bytes` to the file kvlens_`name` in the process's temporary directory (removed
// at exit) and returns its path.
inline std::string WriteTempFile(const std::string& name, const std::string& bytes) {
  const std::string path = ProcessTempDir().File("kvlens_" + name);
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  return path;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_MODEL_GGUF_TEST_WRITER_H_
