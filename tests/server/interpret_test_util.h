// Helpers of the Interpret end-to-end tests: a stub on a TestServer, one GradientProbe call,
// reassembly of an AttentionMaps stream into dense [layer][head][query][key] arrays, tensor
// decoding, and the PyTorch float64 oracle (tests/oracle, autograd) run as a separate
// process.
#ifndef KVLENS_TESTS_SERVER_INTERPRET_TEST_UTIL_H_
#define KVLENS_TESTS_SERVER_INTERPRET_TEST_UTIL_H_

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "kernels/dtype.h"
#include "kvlens/v1/interpret.grpc.pb.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/server_test_util.h"

namespace kvlens::testing {

inline std::unique_ptr<v1::Interpret::Stub> InterpretStub(TestServer& server) {
  return v1::Interpret::NewStub(server.channel());
}

// One GradientProbe call, expected to succeed (the response is returned either way).
inline v1::GradientProbeResponse CallGradientProbe(TestServer& server,
                                                   const v1::GradientProbeRequest& request) {
  auto stub = InterpretStub(server);
  v1::GradientProbeResponse response;
  grpc::ClientContext context;
  SetDeadline(context);
  const grpc::Status status = stub->GradientProbe(&context, request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return response;
}

// Little-endian bytes of `dtype` → doubles.
inline std::vector<double> DecodeValues(const std::string& bytes, v1::DType dtype) {
  std::vector<double> out;
  const char* p = bytes.data();
  if (dtype == v1::DTYPE_FP16) {
    for (size_t i = 0; i + 2 <= bytes.size(); i += 2) {
      uint16_t h;
      std::memcpy(&h, p + i, 2);
      out.push_back(kernels::F16ToF32(h));
    }
  } else if (dtype == v1::DTYPE_FP64) {
    for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      double d;
      std::memcpy(&d, p + i, 8);
      out.push_back(d);
    }
  } else {
    for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
      float f;
      std::memcpy(&f, p + i, 4);
      out.push_back(f);
    }
  }
  return out;
}

inline std::vector<double> DecodeTensor(const v1::Tensor& t) {
  return DecodeValues(t.data(), t.dtype());
}

// The first tensor named `name` at (layer, head), or nullptr.
inline const v1::Tensor* FindTensor(const google::protobuf::RepeatedPtrField<v1::Tensor>& ts,
                                    const std::string& name, int layer, int head) {
  for (const v1::Tensor& t : ts) {
    if (t.name() == name && t.layer() == layer && t.head() == head) return &t;
  }
  return nullptr;
}

struct AttentionResult {
  grpc::Status status;
  v1::AttentionInfo info;
  int chunks = 0;
  // Dense [layers][heads][queries][keys] over the resolved ranges (info).
  std::vector<double> probs, scores;
  std::vector<v1::HeadSummary> summaries;
};

inline AttentionResult RunAttentionMaps(v1::Interpret::Stub& stub,
                                        const v1::AttentionMapsRequest& request) {
  AttentionResult r;
  grpc::ClientContext context;
  SetDeadline(context);
  auto reader = stub.AttentionMaps(&context, request);
  v1::AttentionMapsResponse m;
  int64_t nl = 0, nh = 0, nq = 0, nk = 0;
  while (reader->Read(&m)) {
    if (m.has_info()) {
      r.info = m.info();
      nl = r.info.layers_size();
      nh = r.info.heads_size();
      nq = r.info.queries().end() - r.info.queries().begin();
      nk = r.info.keys().end() - r.info.keys().begin();
      r.probs.assign(nl * nh * nq * nk, NAN);
      r.scores.assign(nl * nh * nq * nk, NAN);
    }
    if (m.has_chunk()) {
      ++r.chunks;
      const v1::AttentionChunk& c = m.chunk();
      int64_t li = 0;
      while (li < nl && r.info.layers(static_cast<int>(li)) != c.layer()) ++li;
      auto place = [&](const std::string& bytes, std::vector<double>& dst) {
        const std::vector<double> v = DecodeValues(bytes, c.dtype());
        size_t at = 0;
        for (int h = 0; h < c.num_heads(); ++h)
          for (int q = 0; q < c.num_queries(); ++q)
            for (int k = 0; k < c.num_keys(); ++k) {
              const int64_t qi = c.query_begin() + q - r.info.queries().begin();
              dst[((li * nh + h) * nq + qi) * nk + k] = v[at++];
            }
      };
      if (!c.probs().empty()) place(c.probs(), r.probs);
      if (!c.scores().empty()) place(c.scores(), r.scores);
    }
    for (const v1::HeadSummary& s : m.head_summaries()) r.summaries.push_back(s);
  }
  r.status = reader->Finish();
  return r;
}

// A session opened on `server` that generated `max_new_tokens` greedy tokens after
// `prompt`, with what the engine holds for it (the last token is not cached yet).
struct GeneratedSession {
  std::string error;  // empty on success
  int64_t id = 0;
  std::vector<int32_t> tokens;
  int cached = 0;
};

inline GeneratedSession OpenSessionAndGenerate(TestServer& server, const std::string& prompt,
                                               int max_new_tokens) {
  GeneratedSession s;
  v1::OpenSessionResponse session;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    if (!server.stub().OpenSession(&context, {}, &session).ok()) {
      s.error = "OpenSession failed";
      return s;
    }
  }
  s.id = session.session_id();
  v1::GenerateRequest g = GreedyRequest(prompt, max_new_tokens);
  g.set_session_id(s.id);
  if (const StreamResult r = RunGenerate(server.stub(), g); !r.status.ok()) {
    s.error = "Generate failed: " + r.status.error_message();
    return s;
  }
  const absl::Status read = server.engine().ReadSession(s.id, [&](const Engine::SessionView& v) {
    s.tokens.assign(v.tokens.begin(), v.tokens.end());
    s.cached = v.num_cached;
  });
  if (!read.ok()) s.error = std::string(read.message());
  return s;
}

// n token ids for stories260K (vocabulary 512): BOS (1), then ids drawn from [3, 512).
inline std::vector<int32_t> RandomPromptTokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t = {1};
  while (static_cast<int>(t.size()) < n) t.push_back(static_cast<int32_t>(3 + rng() % 509));
  return t;
}

// One unary Interpret call (e.g. &v1::Interpret::Stub::Intervene): its status, `response`
// filled when OK.
template <typename Request, typename Response, typename Method>
grpc::Status CallInterpret(TestServer& server, Method method, const Request& request,
                           Response* response) {
  auto stub = InterpretStub(server);
  grpc::ClientContext context;
  SetDeadline(context);
  return ((*stub).*method)(&context, request, response);
}

// A refusal with `code` whose message contains `needle`.
inline void ExpectRefused(const grpc::Status& s, grpc::StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(needle), std::string::npos) << s.error_message();
}
inline void ExpectInvalid(const grpc::Status& s, const std::string& needle) {
  ExpectRefused(s, grpc::StatusCode::INVALID_ARGUMENT, needle);
}

inline v1::PromptInput IdsInput(const std::vector<int32_t>& ids,
                                const std::vector<int32_t>& docs = {}) {
  v1::PromptInput in;
  in.mutable_token_ids()->mutable_ids()->Add(ids.begin(), ids.end());
  in.mutable_doc_ids()->Add(docs.begin(), docs.end());
  return in;
}

// The oracle's gradients of Σ log p(token | row) (and logits, attention) for `tokens`.
// With param_layer ≥ 0, also grad.w{q,k,v,o} of that layer ([out, in]).
inline OracleResult RunGradOracle(const std::string& model, const std::vector<int32_t>& tokens,
                                  const std::vector<std::pair<int, int>>& targets,
                                  const std::vector<int32_t>& docs, int param_layer = -1) {
  std::vector<std::string> t;
  for (const auto& [row, token] : targets) t.push_back(absl::StrCat(row, ":", token));
  std::string args = "--attention --grad-logprob '" + absl::StrJoin(t, " ") + "'";
  if (!docs.empty()) args += " --doc-ids '" + absl::StrJoin(docs, " ") + "'";
  if (param_layer >= 0) args += absl::StrCat(" --grad-param-layer ", param_layer);
  return RunOracleWith(model, tokens, args);
}

// The oracle's gradients of log p(target | last token) with respect to the K/V rows of
// positions < cached, taken as leaves: grad.cached_k.{l}, grad.cached_v.{l} [cached, KV·hd].
inline OracleResult RunCachedKvOracle(const std::string& model, const std::vector<int32_t>& tokens,
                                      int32_t target, int cached) {
  return RunOracleWith(model, tokens,
                       absl::StrCat("--grad-logprob ", tokens.size() - 1, ":", target,
                                    " --grad-cached-kv ", cached));
}

// max|ours − ref| / max|ref| over entries where keep (if given) is true.
inline double RelErr(const std::vector<double>& ours, const std::vector<double>& ref,
                     const std::vector<bool>* keep = nullptr) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ours.size() && i < ref.size(); ++i) {
    if (keep && !(*keep)[i]) continue;
    num = std::max(num, std::abs(ours[i] - ref[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  if (ours.size() != ref.size()) return INFINITY;
  return den > 0 ? num / den : num;
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_SERVER_INTERPRET_TEST_UTIL_H_
