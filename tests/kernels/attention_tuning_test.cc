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
  c.seconds = us * 1e-6;
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
  c[2].seconds = 0;
  EXPECT_EQ(FastestAccepted(c), 0);
  EXPECT_EQ(FastestAccepted({}), -1);
  std::vector<TunedCandidate> none = {Timed("wrong", 10, 1.0)};
  EXPECT_EQ(FastestAccepted(none), -1);
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
      {[](AttentionTuneShape& z) { z.decode_batch = 257; }, "decode_batch 257 must be in [1, 256]"},
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
  EXPECT_NE(text.find("12.5 us  error 0 of 0.1  chosen\n"), std::string::npos) << text;
  EXPECT_NE(text.find("10.0 us  error 0.5 of 0.1  rejected\n"), std::string::npos) << text;
  EXPECT_NE(text.find("kernel c"), std::string::npos) << text;
  EXPECT_NE(text.find("not run: not here\n"), std::string::npos) << text;
  // What was kept: prefill's choice; decode had none.
  EXPECT_EQ(r.Choice(), "prefill layout a");
  r.decode.push_back(Timed("kernel d", 5, 0));
  r.decode.back().chosen = true;
  EXPECT_EQ(r.Choice(), "prefill layout a; decode kernel d");
  EXPECT_EQ(AttentionTuneReport{}.Choice(), "");
}

}  // namespace
}  // namespace kvlens::kernels
