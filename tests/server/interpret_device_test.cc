// --interp-device through the RPCs. On a device double (CPU kernels behind memory that is
// not host-accessible) the workers' fp32 probes run through kernels::StagedBackend: the
// answers must equal the plain CPU workers' bitwise (the same kernels run), and the
// device's memory must have seen the copies (the staged path was taken). fp64 stays on
// the reference. A probe that runs out of the device's memory fails alone: the worker's
// next probe runs (InterpretWorkers calls Backend::Recover before each). The flag's errors,
// without a GPU, are in server_process_test.cc.
#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/fake_device_backend.h"
#include "tests/server/interpret_test_util.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

v1::GradientProbeResponse Probe(TestServer& server, const std::vector<int32_t>& tokens) {
  v1::GradientProbeRequest request;
  *request.mutable_input() = IdsInput(tokens);
  v1::TokenTarget* t = request.mutable_log_prob()->add_targets();
  t->set_position(static_cast<int>(tokens.size()) - 2);
  t->set_token(tokens.back());
  request.set_precision(v1::PRECISION_FP32);
  request.set_embeddings(true);
  request.set_q(true);
  request.set_scores(true);
  request.set_residual(true);
  return CallGradientProbe(server, request);
}

AttentionResult Maps(TestServer& server, const std::vector<int32_t>& tokens) {
  auto stub = InterpretStub(server);
  v1::AttentionMapsRequest request;
  *request.mutable_input() = IdsInput(tokens);
  request.set_scores(true);
  request.set_head_summaries(true);
  return RunAttentionMaps(*stub, request);
}

// A cached-KV probe (fp32) of a fresh session after greedy generation from `prompt`.
v1::CachedKvProbeResponse KvProbe(TestServer& server, const std::string& prompt) {
  const GeneratedSession session = OpenSessionAndGenerate(server, prompt, 6);
  EXPECT_TRUE(session.error.empty()) << session.error;
  auto stub = InterpretStub(server);
  v1::CachedKvProbeRequest r;
  r.set_session_id(session.id);
  r.set_target(42);
  r.set_precision(v1::PRECISION_FP32);
  v1::CachedKvProbeResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  const grpc::Status s = stub->CachedKvProbe(&context, r, &response);
  EXPECT_TRUE(s.ok()) << s.error_message();
  return response;
}

// A probe response of the device workers against the CPU workers': the same objective and
// the same tensors, bitwise.
template <typename Response>
void ExpectSameAnswers(const Response& got, const Response& want) {
  EXPECT_EQ(got.objective(), want.objective());
  ASSERT_EQ(got.tensors_size(), want.tensors_size());
  ASSERT_GT(want.tensors_size(), 0);
  for (int i = 0; i < want.tensors_size(); ++i) {
    EXPECT_EQ(got.tensors(i).name(), want.tensors(i).name());
    EXPECT_EQ(DecodeTensor(got.tensors(i)), DecodeTensor(want.tensors(i)))
        << want.tensors(i).name();
  }
}

// Two servers on stories260K: interpretability workers on the CPU, and on device doubles.
class InterpretDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVLENS_REQUIRE_FILE(Stories260KPath());
    server::InterpretOptions with_device;
    with_device.workers.num_workers = 1;  // every probe on the one worker's backends
    with_device.workers.make_device = [this]() -> std::unique_ptr<kernels::Backend<float>> {
      auto b = std::make_unique<FakeDeviceBackend>();
      std::lock_guard<std::mutex> lock(mu_);
      made_.push_back(b.get());
      return b;
    };
    cpu_server_ = std::make_unique<TestServer>();
    device_server_ = std::make_unique<TestServer>(TestServer::DefaultOptions(), 1, with_device);
    ASSERT_TRUE(cpu_server_->ok()) << cpu_server_->error();
    ASSERT_TRUE(device_server_->ok()) << device_server_->error();
    EXPECT_EQ(device_server_->server().interp_device(), "fake-device");
    EXPECT_EQ(cpu_server_->server().interp_device(), "cpu");
  }
  // Every device double's memory budget (0: none; see FakeDeviceMemory::set_budget): at its
  // bytes in use now, so that no allocation fits.
  void SetBudgets(bool full) {
    std::lock_guard<std::mutex> lock(mu_);
    for (FakeDeviceBackend* b : made_) {
      b->fake_memory().set_budget(full ? std::max<size_t>(b->fake_memory().in_use(), 1) : 0);
    }
  }
  // Copies out of the device doubles' memory so far: the staged path's trace.
  int DeviceCopies() {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_FALSE(made_.empty());
    int copies = 0;
    for (FakeDeviceBackend* b : made_) copies += b->fake_memory().copies_to_host;
    return copies;
  }

  std::mutex mu_;
  std::vector<FakeDeviceBackend*> made_;
  std::unique_ptr<TestServer> cpu_server_, device_server_;
};

TEST_F(InterpretDeviceTest, Fp32ProbesThroughAStagedDeviceEqualTheCpuWorkers) {
  TestServer& cpu_server = *cpu_server_;
  TestServer& device_server = *device_server_;

  const std::vector<int32_t> tokens =
      cpu_server.model().tokenizer->Encode("Once upon a time, there was a little girl", true);
  const AttentionResult want = Maps(cpu_server, tokens);
  const AttentionResult got = Maps(device_server, tokens);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  ASSERT_FALSE(want.probs.empty());
  EXPECT_EQ(got.probs, want.probs);
  EXPECT_EQ(got.scores, want.scores);
  ASSERT_EQ(got.summaries.size(), want.summaries.size());

  const v1::GradientProbeResponse pw = Probe(cpu_server, tokens);
  const v1::GradientProbeResponse pg = Probe(device_server, tokens);
  ExpectSameAnswers(pg, pw);

  EXPECT_GT(DeviceCopies(), 0) << "the probes did not run on the device";
}

// The cached-KV probe took the worker's CPU backend even with a device; it now runs
// where the other fp32 probes do, with the same answers.
TEST_F(InterpretDeviceTest, CachedKvProbeRunsOnTheStagedDeviceAndEqualsTheCpuWorkers) {
  const v1::CachedKvProbeResponse want = KvProbe(*cpu_server_, "Once upon a time");
  const int before = DeviceCopies();
  const v1::CachedKvProbeResponse got = KvProbe(*device_server_, "Once upon a time");
  EXPECT_GT(DeviceCopies(), before) << "the cached-KV probe did not run on the device";
  ASSERT_GT(want.num_cached(), 0);
  EXPECT_EQ(got.num_cached(), want.num_cached());
  ExpectSameAnswers(got, want);
}

// A probe whose staging does not fit in the device's memory fails RESOURCE_EXHAUSTED, and
// only that probe: the worker's next one (the device's memory as full as before) runs and
// equals the CPU workers'.
TEST_F(InterpretDeviceTest, AProbeThatRunsOutOfDeviceMemoryFailsAloneAndTheNextRuns) {
  const std::vector<int32_t> small =
      cpu_server_->model().tokenizer->Encode("Once upon a time", true);
  const std::vector<int32_t> large = cpu_server_->model().tokenizer->Encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside", true);
  const AttentionResult want = Maps(*cpu_server_, small);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_TRUE(Maps(*device_server_, small).status.ok());  // the staging sized for `small`

  SetBudgets(/*full=*/true);
  const AttentionResult failed = Maps(*device_server_, large);
  EXPECT_EQ(failed.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << failed.status.error_message();
  EXPECT_NE(failed.status.error_message().find("out of memory"), std::string::npos)
      << failed.status.error_message();
  const AttentionResult after = Maps(*device_server_, small);
  SetBudgets(/*full=*/false);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.probs, want.probs);
  EXPECT_EQ(after.scores, want.scores);
}

}  // namespace
}  // namespace kvlens::testing
