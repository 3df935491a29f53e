// The attention tuner's host side (kernels/attention_tuning.h): which candidate it keeps,
// the shape's checks and the report's lines. The tuner itself runs in
// tests/kernels/cuda/attention_tuner_test.cc (on a GPU, or on the CUDA emulator).
#include "kernels/attention_tuning.h"

#include <cmath>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

TunedCandidate Timed(const char* name, double us, double error, double tolerance = 0.1) {
  TunedCandidate c;
  c.name = name;
  c.seconds = {us * 1e-6};
  c.max_error = error;
  c.tolerance = tolerance;
  return c;
}

TEST(AttentionTuningTest, KeepsTheFastestCandidateThatAgrees) {
  std::vector<TunedCandidate> c = {Timed("default", 30, 0), Timed("fast but wrong", 10, 0.5),
                                   Timed("faster", 20, 0.05), Timed("slow", 40, 0)};
  EXPECT_EQ(FastestAccepted(c), 2);
  // An error of exactly the tolerance agrees; NaN never does.
  c[1].max_error = 0.1;
  EXPECT_EQ(FastestAccepted(c), 1);
  c[1].max_error = std::nan("");
  EXPECT_FALSE(c[1].accepted());
  EXPECT_EQ(FastestAccepted(c), 2);
  // A candidate that could not run is never kept, however short its (unset) time.
  c[2].failure = "refused";
  c[2].seconds = {};
  EXPECT_EQ(FastestAccepted(c), 0);
  EXPECT_EQ(FastestAccepted({}), -1);
  std::vector<TunedCandidate> none = {Timed("wrong", 10, 1.0)};
  EXPECT_EQ(FastestAccepted(none), -1);
}

TunedCandidate TimedTwice(const char* name, double us1, double us2) {
  TunedCandidate c = Timed(name, us1, 0);
  c.seconds.push_back(us2 * 1e-6);
  return c;
}

// Decode timed at one sequence and at a loaded batch: each batch counts alike, as the mean
// of the candidate's times over the default's. A kernel 20% faster for one sequence but
// twice as slow at the batch (0.8 and 2.0: 1.4) loses to one 10% slower for one sequence
// and 30% faster at the batch (1.1 and 0.7: 0.9), though the latter's total time, 121 µs,
// is longer than the former's 88 — what a sum of seconds would choose.
TEST(AttentionTuningTest, EachDecodeBatchCountsAlike) {
  const std::vector<TunedCandidate> c = {TimedTwice("default", 10, 100),
                                         TimedTwice("good at one", 8, 200),
                                         TimedTwice("good at the batch", 11, 70)};
  const std::vector<double> relative = RelativeTimes(c);
  ASSERT_EQ(relative.size(), 3u);
  EXPECT_DOUBLE_EQ(relative[0], 1.0);
  EXPECT_DOUBLE_EQ(relative[1], (0.8 + 2.0) / 2);
  EXPECT_DOUBLE_EQ(relative[2], (1.1 + 0.7) / 2);
  EXPECT_EQ(FastestAccepted(c), 2);
}

// Times are relative to the first candidate that ran: when the backend refused the
// default, to the next; a candidate that did not run gets 0 and is never kept.
TEST(AttentionTuningTest, RelativeToTheFirstCandidateThatRan) {
  std::vector<TunedCandidate> c = {Timed("default", 0, 0), TimedTwice("first to run", 20, 40),
                                   TimedTwice("next", 10, 80)};
  c[0].failure = "refused";
  c[0].seconds = {};
  const std::vector<double> relative = RelativeTimes(c);
  EXPECT_EQ(relative[0], 0.0);
  EXPECT_DOUBLE_EQ(relative[1], 1.0);
  EXPECT_DOUBLE_EQ(relative[2], (0.5 + 2.0) / 2);
  EXPECT_EQ(FastestAccepted(c), 1);
  // One that timed fewer calls than the reference is not compared.
  c[2].seconds.pop_back();
  EXPECT_EQ(RelativeTimes(c)[2], 0.0);
  EXPECT_EQ(FastestAccepted(c), 1);
}

AttentionTuneShape Llama() {
  AttentionTuneShape z;
  z.num_heads = 32;
  z.num_kv_heads = 8;
  z.head_dim = 128;
  return z;
}

// Each bad field is named with its limit.
TEST(AttentionTuningTest, ShapeErrorsNameTheFieldAndTheLimit) {
  EXPECT_TRUE(Llama().Validate().ok());
  struct Case {
    void (*edit)(AttentionTuneShape&);
    const char* message;
  };
  const Case cases[] = {
      {[](AttentionTuneShape& z) { z.num_heads = 0; }, "num_heads 0 must be >= 1"},
      {[](AttentionTuneShape& z) { z.num_kv_heads = 3; },
       "num_kv_heads 3 must be >= 1 and divide num_heads 32"},
      {[](AttentionTuneShape& z) { z.head_dim = 513; }, "head_dim 513 must be in [1, 512]"},
      {[](AttentionTuneShape& z) { z.block_size = 0; }, "block_size 0 must be in [1, 1024]"},
      {[](AttentionTuneShape& z) { z.prefill_tokens = -1; },
       "prefill_tokens -1 must be in [0, 131072]"},
      {[](AttentionTuneShape& z) { z.decode_keys = 131073; },
       "decode_keys 131073 must be in [0, 131072]"},
      {[](AttentionTuneShape& z) {
         z.decode_batches = {1, 257};
       },
       "decode_batches[1] 257 must be in [1, 256]"},
      {[](AttentionTuneShape& z) { z.decode_batches = {0}; },
       "decode_batches[0] 0 must be in [1, 256]"},
      {[](AttentionTuneShape& z) { z.decode_batches = {}; },
       "decode_batches size 0 must be in [1, 4]"},
      {[](AttentionTuneShape& z) {
         z.decode_batches = {1, 2, 4, 8, 16};
       },
       "decode_batches size 5 must be in [1, 4]"},
      {[](AttentionTuneShape& z) { z.softcap = -1; }, "softcap -1 must be >= 0"},
  };
  for (const Case& c : cases) {
    AttentionTuneShape z = Llama();
    c.edit(z);
    const absl::Status s = z.Validate();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(s.message(), std::string("attention tuning: ") + c.message);
  }
}

TEST(AttentionTuningTest, ReportMarksTheChoiceAndTheRejects) {
  AttentionTuneReport r;
  r.shape = "a shape";
  r.prefill = {Timed("layout a", 12.5, 0), Timed("layout b", 10, 0.5)};
  r.prefill[0].chosen = true;
  TunedCandidate refused;
  refused.name = "kernel c";
  refused.failure = "not here";
  r.decode = {refused};
  const std::string text = r.ToString();
  EXPECT_EQ(text.rfind("attention tuning: a shape\n", 0), 0u) << text;
  EXPECT_NE(text.find("layout a"), std::string::npos) << text;
  EXPECT_NE(text.find("12.5 us  1.00x  error 0 of 0.1  chosen\n"), std::string::npos) << text;
  EXPECT_NE(text.find("10.0 us  0.80x  error 0.5 of 0.1  rejected\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kernel c"), std::string::npos) << text;
  EXPECT_NE(text.find("not run: not here\n"), std::string::npos) << text;
  // What was kept: prefill's choice; decode had none.
  EXPECT_EQ(r.Choice(), "prefill layout a");
  r.decode.push_back(TimedTwice("kernel d", 5, 40));
  r.decode.back().chosen = true;
  EXPECT_EQ(r.Choice(), "prefill layout a; decode kernel d");
  // A decode candidate's time at each batch, relative to the first that ran (itself).
  EXPECT_NE(r.ToString().find("5.0 / 40.0 us  1.00x  error 0 of 0.1  chosen\n"), std::string::npos)
      << r.ToString();
  EXPECT_EQ(AttentionTuneReport{}.Choice(), "");
}

}  // namespace
}  // namespace kvlens::kernels
