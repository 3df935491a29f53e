// A tiny safetensors writer for tests: a JSON header the test may bend field by field, and
// the data section it indexes. Also f16/bf16 encoders for values exactly representable in
// them, written from the formats' bit layouts (not from kernels/dtype.h, which is what the
// loaders use to read them back).
#ifndef KVLENS_TESTS_ENGINE_MODEL_SAFETENSORS_TEST_WRITER_H_
#define KVLENS_TESTS_ENGINE_MODEL_SAFETENSORS_TEST_WRITER_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/model/gguf_test_writer.h"

namespace kvlens::testing {

// bf16 is the top half of a float: exact when the low 16 bits are zero.
inline uint16_t ExactBf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  EXPECT_EQ(x & 0xffffu, 0u) << f << " is not exact in bf16";
  return static_cast<uint16_t>(x >> 16);
}

// IEEE half of a float that is zero or a normal half with at most 10 mantissa bits.
inline uint16_t ExactF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  if ((x & 0x7fffffffu) == 0) return static_cast<uint16_t>(sign);
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  EXPECT_TRUE(exp > 0 && exp < 31 && (x & 0x1fffu) == 0) << f << " is not exact in f16";
  return static_cast<uint16_t>(sign | (static_cast<uint32_t>(exp) << 10) | ((x >> 13) & 0x3ffu));
}

class SafetensorsWriter {
 public:
  // The header as it will be written; tests may edit any entry before Bytes().
  nlohmann::json header = nlohmann::json::object();
  std::string data;

  // Appends `bytes` to the data section and indexes them as tensor `name`.
  void Add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
           const std::string& bytes) {
    header[name] = {{"dtype", dtype},
                    {"shape", shape},
                    {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
  }
  void AddF32(const std::string& name, const std::vector<int64_t>& shape,
              const std::vector<float>& v) {
    std::string b;
    for (float f : v) b += Le(f);
    Add(name, "F32", shape, b);
  }
  void AddF16(const std::string& name, const std::vector<int64_t>& shape,
              const std::vector<float>& v) {
    std::string b;
    for (float f : v) b += Le(ExactF16(f));
    Add(name, "F16", shape, b);
  }
  void AddBF16(const std::string& name, const std::vector<int64_t>& shape,
               const std::vector<float>& v) {
    std::string b;
    for (float f : v) b += Le(ExactBf16(f));
    Add(name, "BF16", shape, b);
  }

  // u64 header size, the header padded with spaces to a multiple of 8 (as the reference
  // writer does, so that data offsets stay aligned), the data.
  std::string Bytes() const { return Raw(header.dump(), data); }
  static std::string Raw(std::string header_text, const std::string& data) {
    header_text.resize((header_text.size() + 7) / 8 * 8, ' ');
    return Le<uint64_t>(header_text.size()) + header_text + data;
  }
};

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_MODEL_SAFETENSORS_TEST_WRITER_H_
