// --interp-device through the RPCs. On a device double (CPU kernels behind memory that is
// not host-accessible) the workers' fp32 probes run through kernels::StagedBackend: the
// answers must equal the plain CPU workers' bitwise (the same kernels run), and the
// device's memory must have seen the copies (the staged path was taken). fp64 stays on
// the reference. The flag's errors, without a GPU, are in server_process_test.cc.
#include <memory>
#include <mutex>
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

TEST(InterpretDeviceTest, Fp32ProbesThroughAStagedDeviceEqualTheCpuWorkers) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  std::mutex mu;
  std::vector<FakeDeviceBackend*> made;
  server::InterpretOptions with_device;
  with_device.workers.make_device = [&]() -> std::unique_ptr<kernels::Backend<float>> {
    auto b = std::make_unique<FakeDeviceBackend>();
    std::lock_guard<std::mutex> lock(mu);
    made.push_back(b.get());
    return b;
  };
  TestServer cpu_server;
  TestServer device_server(TestServer::DefaultOptions(), 1, with_device);
  ASSERT_TRUE(cpu_server.ok()) << cpu_server.error();
  ASSERT_TRUE(device_server.ok()) << device_server.error();
  EXPECT_EQ(device_server.server().interp_device(), "fake-device");
  EXPECT_EQ(cpu_server.server().interp_device(), "cpu");

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
  EXPECT_EQ(pg.objective(), pw.objective());
  ASSERT_EQ(pg.tensors_size(), pw.tensors_size());
  ASSERT_GT(pw.tensors_size(), 0);
  for (int i = 0; i < pw.tensors_size(); ++i) {
    EXPECT_EQ(pg.tensors(i).name(), pw.tensors(i).name());
    EXPECT_EQ(DecodeTensor(pg.tensors(i)), DecodeTensor(pw.tensors(i))) << pw.tensors(i).name();
  }

  int copies = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_FALSE(made.empty());
    for (FakeDeviceBackend* b : made) copies += b->fake_memory().copies_to_host;
  }
  EXPECT_GT(copies, 0) << "the probes did not run on the device";
}

}  // namespace
}  // namespace kvlens::testing
