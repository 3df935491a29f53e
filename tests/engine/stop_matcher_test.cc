#include "engine/stop_matcher.h"

#include "gtest/gtest.h"

namespace kvlens {
namespace {

TEST(StopMatcherTest, HoldsBackAPossibleStopPrefixUntilDecided) {
  StopMatcher m({"END"});
  auto r = m.Push("abc E");
  EXPECT_EQ(r.emit, "abc ");
  EXPECT_FALSE(r.matched);
  r = m.Push("N");
  EXPECT_EQ(r.emit, "");
  r = m.Push("X");  // "ENX" can no longer become "END"
  EXPECT_EQ(r.emit, "ENX");
  r = m.Push("yyEN");
  EXPECT_EQ(r.emit, "yy");
  r = m.Push("D and more");
  EXPECT_TRUE(r.matched);
  EXPECT_EQ(r.emit, "");
}

TEST(StopMatcherTest, EarliestOfSeveralStopsWins) {
  StopMatcher m({"world", "lo w"});
  auto r = m.Push("hello world");
  EXPECT_TRUE(r.matched);
  EXPECT_EQ(r.emit, "hel");
}

TEST(StopMatcherTest, NoStopsPassesEverythingAndFlushReturnsHeldText) {
  StopMatcher none;
  EXPECT_EQ(none.Push("x").emit, "x");
  StopMatcher m({"</s>"});
  EXPECT_EQ(m.Push("a</").emit, "a");
  EXPECT_EQ(m.Flush("!"), "</!");
}

}  // namespace
}  // namespace kvlens
