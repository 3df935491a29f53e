// ToIndex and ToIndexList against indices worked by hand: on an axis of 4, −1 is 3 and −4
// is 0; 4 and −5 are refused naming the field and [−4, 4); a list resolves in order,
// empty is every index, and one index from both ends is repeated.
#include "server/index_convert.h"

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace kvlens::server {
namespace {

google::protobuf::RepeatedField<int32_t> Ids(std::initializer_list<int32_t> v) {
  return google::protobuf::RepeatedField<int32_t>(v.begin(), v.end());
}

TEST(IndexConvert, CountsFromEitherEnd) {
  EXPECT_EQ(*ToIndex(0, 4, "x"), 0);
  EXPECT_EQ(*ToIndex(3, 4, "x"), 3);
  EXPECT_EQ(*ToIndex(-1, 4, "x"), 3);
  EXPECT_EQ(*ToIndex(-4, 4, "x"), 0);
  for (int64_t bad : {int64_t{4}, int64_t{-5}, int64_t{1} << 40, -(int64_t{1} << 40)}) {
    const absl::StatusOr<int> r = ToIndex(bad, 4, "heads[2]");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(r.status().message(), absl::StrCat("heads[2] = ", bad,
                                                 " must be in [-4, 4) (negative: from the end, "
                                                 "-1 the last)"));
  }
  EXPECT_FALSE(ToIndex(0, 0, "x").ok());  // an empty axis has no index
}

TEST(IndexConvert, ListsResolveInOrder) {
  EXPECT_EQ(*ToIndexList(Ids({}), 3, "layers"), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(*ToIndexList(Ids({-1, 0, -2}), 3, "layers"), (std::vector<int>{2, 0, 1}));
  const auto twice = ToIndexList(Ids({2, -1}), 3, "layers");
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().message(), "layers[1] = -1 (2) is repeated");
  const auto same = ToIndexList(Ids({1, 1}), 3, "layers");
  ASSERT_FALSE(same.ok());
  EXPECT_EQ(same.status().message(), "layers[1] = 1 is repeated");
  const auto out = ToIndexList(Ids({0, -4}), 3, "layers");
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("layers[1] = -4 must be in [-3, 3)"), std::string::npos);
}

}  // namespace
}  // namespace kvlens::server
