// --kv-cache-dtype's names, element sizes, and the host's loads and stores.
#include "kernels/kv_dtype.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

TEST(KvDtypeTest, ParsesTheFlagsSpellings) {
  EXPECT_EQ(*ParseKvDtype("auto"), KvDtype::kActivation);
  EXPECT_EQ(*ParseKvDtype("bf16"), KvDtype::kBF16);
  EXPECT_EQ(*ParseKvDtype("bfloat16"), KvDtype::kBF16);
  for (const char* bad : {"", "fp8", "BF16", "f16"}) {
    const auto d = ParseKvDtype(bad);
    ASSERT_FALSE(d.ok()) << bad;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.status().message().find("kv_cache_dtype"), std::string_view::npos);
    EXPECT_NE(d.status().message().find("auto or bf16"), std::string_view::npos);
  }
  EXPECT_EQ(KvDtypeName(KvDtype::kActivation), "auto");
  EXPECT_EQ(KvDtypeName(KvDtype::kBF16), "bf16");
}

TEST(KvDtypeTest, ElementBytes) {
  EXPECT_EQ(KvElementBytes<float>(KvDtype::kActivation), 4);
  EXPECT_EQ(KvElementBytes<double>(KvDtype::kActivation), 8);
  EXPECT_EQ(KvElementBytes<float>(KvDtype::kBF16), 2);
  EXPECT_EQ(KvElementBytes<double>(KvDtype::kBF16), 2);
}

// 0x4049 is (1 + 73/128) · 2 = 3.140625; π rounds to it (the next bf16, 3.15625, is further).
TEST(KvDtypeTest, LoadsAndStoresRoundTrip) {
  const std::vector<uint16_t> bits = {0x4049, 0xBF80};
  EXPECT_EQ(KvLoad<double>(bits.data(), 0, KvDtype::kBF16), 3.140625);
  EXPECT_EQ(KvLoad<float>(bits.data(), 1, KvDtype::kBF16), -1.0f);
  const double pi = 3.141592653589793;
  std::vector<uint16_t> out(3, 0);
  KvStoreRow(out.data(), 1, &pi, 1, KvDtype::kBF16);
  EXPECT_EQ(out, (std::vector<uint16_t>{0, 0x4049, 0}));
  std::vector<double> same(2, 0.0);
  KvStoreRow(same.data(), 1, &pi, 1, KvDtype::kActivation);
  EXPECT_EQ(same[1], pi);
  EXPECT_EQ(KvLoad<double>(same.data(), 1, KvDtype::kActivation), pi);
}

}  // namespace
}  // namespace kvlens::kernels
