// Attention rows streamed during Generate equal Interpret.AttentionMaps over the full
// sequence: each generated token at position p carries the row of query p − 1 over keys
// 0 … p − 1, for the chosen layers and heads, computed by the live engine on its KV cache
// (while other requests share the batch).
#include <thread>

#include "gtest/gtest.h"
#include "tests/server/interpret_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

struct RowsResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::vector<v1::AttentionRow> rows;
};

RowsResult GenerateWithRows(v1::Generation::Stub& stub, const v1::GenerateRequest& request) {
  RowsResult r;
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse chunk;
  while (reader->Read(&chunk)) {
    r.tokens.insert(r.tokens.end(), chunk.token_ids().begin(), chunk.token_ids().end());
    r.rows.insert(r.rows.end(), chunk.attention_rows().begin(), chunk.attention_rows().end());
  }
  r.status = reader->Finish();
  return r;
}

TEST(InterpretStream, GenerateRowsEqualAttentionMaps) {
  KVLENS_REQUIRE_FILE(Stories260KPath());
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  auto stub = InterpretStub(server);
  const ModelConfig& c = server.model().config;
  const std::string text = "Once upon a time";
  const std::vector<int32_t> prompt = server.model().tokenizer->Encode(text, true);
  const int P = static_cast<int>(prompt.size());

  for (const bool all : {false, true}) {
    v1::GenerateRequest request = GreedyRequest(text, 12);
    std::vector<int> layers = {3, 0}, heads = {6, 1};
    if (all) {
      request.mutable_attention_rows();  // present, empty: every layer and head
      layers.clear();
      heads.clear();
      for (int l = 0; l < c.num_layers; ++l) layers.push_back(l);
      for (int h = 0; h < c.num_heads; ++h) heads.push_back(h);
    } else {
      request.mutable_attention_rows()->mutable_layers()->Add(layers.begin(), layers.end());
      request.mutable_attention_rows()->mutable_heads()->Add(heads.begin(), heads.end());
    }
    // A plain request alongside, so rows are captured while the batch holds others.
    RowsResult plain;
    std::thread other([&] { plain = GenerateWithRows(server.stub(), GreedyRequest("Lily", 20)); });
    const RowsResult r = GenerateWithRows(server.stub(), request);
    other.join();
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    ASSERT_TRUE(plain.status.ok());
    EXPECT_TRUE(plain.rows.empty());
    ASSERT_EQ(r.rows.size(), r.tokens.size());

    std::vector<int32_t> full = prompt;
    full.insert(full.end(), r.tokens.begin(), r.tokens.end() - 1);
    v1::AttentionMapsRequest maps;
    *maps.mutable_input() = IdsInput(full);
    maps.mutable_layers()->Add(layers.begin(), layers.end());
    maps.mutable_heads()->Add(heads.begin(), heads.end());
    const AttentionResult ref = RunAttentionMaps(*stub, maps);
    ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
    const int n = static_cast<int>(full.size());
    const size_t nl = layers.size(), nh = heads.size();
    double worst = 0;
    for (size_t i = 0; i < r.rows.size(); ++i) {
      const v1::AttentionRow& row = r.rows[i];
      const int q = P + static_cast<int>(i) - 1;  // the query that produced token i
      ASSERT_EQ(row.query_position(), q);
      ASSERT_EQ(row.num_keys(), q + 1);
      ASSERT_EQ(static_cast<size_t>(row.probs_size()), nl * nh * (q + 1));
      // every layer and head spelled out when the request named none
      EXPECT_EQ(std::vector<int>(row.layers().begin(), row.layers().end()), layers);
      EXPECT_EQ(std::vector<int>(row.heads().begin(), row.heads().end()), heads);
      for (size_t li = 0; li < nl; ++li) {
        for (size_t hi = 0; hi < nh; ++hi) {
          double sum = 0;
          for (int k = 0; k <= q; ++k) {
            const double got = row.probs(static_cast<int>((li * nh + hi) * (q + 1) + k));
            const double want = ref.probs[((li * nh + hi) * n + q) * n + k];
            worst = std::max(worst, std::abs(got - want));
            sum += got;
          }
          EXPECT_NEAR(sum, 1.0, 1e-5);
        }
      }
    }
    // Both fp32: the engine's batched kernels against the probe tape's loop.
    EXPECT_LE(worst, 1e-5);
    std::printf("[interp] streamed rows (%s) vs AttentionMaps: max abs diff %.3g over %zu tokens\n",
                all ? "all layers/heads" : "2 layers x 2 heads", worst, r.rows.size());
  }

  // A bad layer is named.
  v1::GenerateRequest bad = GreedyRequest(text, 2);
  bad.mutable_attention_rows()->add_layers(c.num_layers);
  const RowsResult e = GenerateWithRows(server.stub(), bad);
  EXPECT_EQ(e.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(e.status.error_message().find("attention_rows.layers[0]"), std::string::npos)
      << e.status.error_message();
}

}  // namespace
}  // namespace kvlens::testing
