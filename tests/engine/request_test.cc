// The request fields checked against the model before a request is queued:
// AttentionRowsRequest::Validate names the field and the limit for each bad value.
#include "engine/request.h"

#include <string>

#include "gtest/gtest.h"

namespace kvlens {
namespace {

void ExpectRefused(const AttentionRowsRequest& rows, const std::string& message) {
  const absl::Status s = rows.Validate(/*num_layers=*/4, /*num_heads=*/8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(message), std::string::npos) << s;
}

TEST(AttentionRowsRequestTest, AcceptsNoneAndRowsInRange) {
  EXPECT_TRUE(AttentionRowsRequest{}.Validate(4, 8).ok());
  EXPECT_TRUE((AttentionRowsRequest{{0, 3}, {0, 7}}.Validate(4, 8).ok()));
}

TEST(AttentionRowsRequestTest, RefusesOneListWithoutTheOther) {
  ExpectRefused({{1}, {}}, "attention_rows: give both layers and heads");
  ExpectRefused({{}, {2}}, "attention_rows: give both layers and heads");
}

TEST(AttentionRowsRequestTest, RefusesLayersAndHeadsOutsideTheModel) {
  ExpectRefused({{0, 4}, {0}}, "attention_rows layer 4 is outside [0, 4)");
  ExpectRefused({{-1}, {0}}, "attention_rows layer -1 is outside [0, 4)");
  ExpectRefused({{0}, {8}}, "attention_rows head 8 is outside [0, 8)");
  ExpectRefused({{0}, {-2}}, "attention_rows head -2 is outside [0, 8)");
}

}  // namespace
}  // namespace kvlens
