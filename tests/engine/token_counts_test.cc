#include "engine/token_counts.h"

#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens {
namespace {

using Entries = std::vector<std::pair<int32_t, int32_t>>;

Entries Of(const TokenCounts& c) { return Entries(c.entries().begin(), c.entries().end()); }

// Each token once, in order of first appearance, with how often it occurs; a longer
// history counts only its new tokens; negative ids are skipped.
TEST(TokenCountsTest, CountsTheNewTokensOfAGrowingHistory) {
  TokenCounts c;
  std::vector<int32_t> history = {5, 3, 5};
  c.Update(history);
  EXPECT_EQ(Of(c), (Entries{{5, 2}, {3, 1}}));
  EXPECT_EQ(c.Counted(), 3u);
  c.Update(history);  // nothing new
  EXPECT_EQ(Of(c), (Entries{{5, 2}, {3, 1}}));
  history.insert(history.end(), {-1, 3, 7, 5});
  c.Update(history);
  EXPECT_EQ(Of(c), (Entries{{5, 3}, {3, 2}, {7, 1}}));
  EXPECT_EQ(c.Counted(), 7u);
}

}  // namespace
}  // namespace kvlens
