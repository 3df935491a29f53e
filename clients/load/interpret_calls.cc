// AttentionMaps / GradientProbe / Activations / LogitAttribution / PatchSweep traffic. Compiled
// with KVLENS_LOAD_INTERPRET when kvlens_proto carries interpret.proto; without it the factories
// say "unsupported" and kvlens-load rejects the --*-share flags. A new unary
// interpretability kind is one more UnaryCall alias and request builder here and one more
// Kind in workload.h.
#include <algorithm>
#include <utility>

#include "clients/load/calls.h"

#ifdef KVLENS_LOAD_INTERPRET
#include "kvlens/v1/interpret.grpc.pb.h"
#endif

namespace kvlens::load {

#ifdef KVLENS_LOAD_INTERPRET
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void SetInput(const RequestSpec& spec, v1::PromptInput* input) {
  if (spec.text.empty()) {
    input->mutable_token_ids()->mutable_ids()->Assign(spec.token_ids.begin(), spec.token_ids.end());
  } else {
    input->set_text(spec.text);
  }
}

// Every layer and head of the prompt, fp32, streamed in chunks.
class AttentionCall final : public Call, public grpc::ClientReadReactor<v1::AttentionMapsResponse> {
 public:
  AttentionCall(v1::Interpret::Stub* stub, const RequestSpec& spec,
                std::chrono::milliseconds timeout)
      : stub_(stub) {
    SetInput(spec, request_.mutable_input());
    context_.set_deadline(std::chrono::system_clock::now() + timeout);
    result_.kind = Kind::kAttention;
  }

  void Start(DoneFn done) override {
    done_ = std::move(done);
    start_ = Clock::now();
    stub_->async()->AttentionMaps(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }
  void Cancel() override { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    if (result_.ttft_seconds < 0) result_.ttft_seconds = Seconds(Clock::now() - start_);
    result_.response_bytes += static_cast<int64_t>(response_.ByteSizeLong());
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    result_.e2e_seconds = Seconds(Clock::now() - start_);
    result_.code = status.error_code();
    if (!status.ok()) result_.message = status.error_message();
    done_(this, std::move(result_));
  }

 private:
  v1::Interpret::Stub* stub_;
  v1::AttentionMapsRequest request_;
  v1::AttentionMapsResponse response_;
  grpc::ClientContext context_;
  DoneFn done_;
  Clock::time_point start_;
  CallResult result_;
};

// One unary Interpret call: `Rpc` is the stub's async method for Request → Response.
template <typename Request, typename Response,
          void (v1::Interpret::Stub::async_interface::*Rpc)(grpc::ClientContext*, const Request*,
                                                            Response*, grpc::ClientUnaryReactor*)>
class UnaryCall final : public Call, public grpc::ClientUnaryReactor {
 public:
  UnaryCall(v1::Interpret::Stub* stub, Request request, Kind kind,
            std::chrono::milliseconds timeout)
      : stub_(stub), request_(std::move(request)) {
    context_.set_deadline(std::chrono::system_clock::now() + timeout);
    result_.kind = kind;
  }

  void Start(DoneFn done) override {
    done_ = std::move(done);
    start_ = Clock::now();
    (stub_->async()->*Rpc)(&context_, &request_, &response_, this);
    StartCall();
  }
  void Cancel() override { context_.TryCancel(); }

  void OnDone(const grpc::Status& status) override {
    result_.e2e_seconds = Seconds(Clock::now() - start_);
    result_.code = status.error_code();
    if (status.ok()) {
      result_.response_bytes = static_cast<int64_t>(response_.ByteSizeLong());
    } else {
      result_.message = status.error_message();
    }
    done_(this, std::move(result_));
  }

 private:
  v1::Interpret::Stub* stub_;
  Request request_;
  Response response_;
  grpc::ClientContext context_;
  DoneFn done_;
  Clock::time_point start_;
  CallResult result_;
};

using ProbeCall = UnaryCall<v1::GradientProbeRequest, v1::GradientProbeResponse,
                            &v1::Interpret::Stub::async_interface::GradientProbe>;
using ActivationsCall = UnaryCall<v1::ActivationsRequest, v1::ActivationsResponse,
                                  &v1::Interpret::Stub::async_interface::Activations>;
using AttributionCall = UnaryCall<v1::LogitAttributionRequest, v1::LogitAttributionResponse,
                                  &v1::Interpret::Stub::async_interface::LogitAttribution>;
using PatchCall = UnaryCall<v1::PatchSweepRequest, v1::PatchSweepResponse,
                            &v1::Interpret::Stub::async_interface::PatchSweep>;

// The last prompt token after the tokens before it (text prompts, whose ids only the
// server knows: token 0 after the whole prompt, position −1).
void SetLastTokenTarget(const RequestSpec& spec, v1::TokenTarget* target) {
  const int n = static_cast<int>(spec.token_ids.size());
  target->set_position(n >= 2 ? n - 2 : -1);
  target->set_token(n >= 2 ? spec.token_ids[n - 1] : 0);
}

// J = log p(the last prompt token), so the backward runs through every position;
// gradients w.r.t. the input embeddings and their saliency.
v1::GradientProbeRequest ProbeRequest(const RequestSpec& spec) {
  v1::GradientProbeRequest r;
  SetInput(spec, r.mutable_input());
  SetLastTokenTarget(spec, r.mutable_log_prob()->add_targets());
  r.set_embeddings(true);
  return r;
}

// The residual stream entering every layer at every position (run_with_cache's resid_pre).
v1::ActivationsRequest ActivationsRequest(const RequestSpec& spec) {
  v1::ActivationsRequest r;
  SetInput(spec, r.mutable_input());
  r.add_hooks("resid_pre");
  return r;
}

// The last position's logit of the prompt's last token (text prompts: token 0), split by
// layer and head.
v1::LogitAttributionRequest AttributionRequest(const RequestSpec& spec) {
  v1::LogitAttributionRequest r;
  SetInput(spec, r.mutable_input());
  r.set_token(spec.token_ids.empty() ? 0 : spec.token_ids.back());
  r.set_heads(true);
  return r;
}

// The head-level heatmap circuit work starts from: every head's output z in the last layer
// patched at every position at once (all_positions: a forward of the last layer per head),
// scored by the probe's log p. The source is the prompt's ids reversed (same length); a
// text prompt, whose ids only the server knows, is patched from itself (the same cost).
v1::PatchSweepRequest PatchRequest(const RequestSpec& spec) {
  v1::PatchSweepRequest r;
  SetInput(spec, r.mutable_input());
  RequestSpec source = spec;
  std::reverse(source.token_ids.begin(), source.token_ids.end());
  SetInput(source, r.mutable_patch_source());
  r.set_hook("z");
  r.add_layers(-1);
  r.set_all_positions(true);
  SetLastTokenTarget(spec, r.mutable_log_prob()->add_targets());
  return r;
}

}  // namespace

bool InterpretSupported() { return true; }

std::unique_ptr<Call> MakeInterpretCall(const ServerStubs& stubs, const RequestSpec& spec,
                                        std::chrono::milliseconds timeout) {
  auto* stub = static_cast<v1::Interpret::Stub*>(stubs.interpret.get());
  if (spec.kind == Kind::kAttention) return std::make_unique<AttentionCall>(stub, spec, timeout);
  switch (spec.kind) {
    case Kind::kProbe:
      return std::make_unique<ProbeCall>(stub, ProbeRequest(spec), spec.kind, timeout);
    case Kind::kActivations:
      return std::make_unique<ActivationsCall>(stub, ActivationsRequest(spec), spec.kind, timeout);
    case Kind::kAttribution:
      return std::make_unique<AttributionCall>(stub, AttributionRequest(spec), spec.kind, timeout);
    case Kind::kPatch:
      return std::make_unique<PatchCall>(stub, PatchRequest(spec), spec.kind, timeout);
    default:
      break;
  }
  return nullptr;
}

ServerStubs MakeStubs(const std::string& address) {
  ServerStubs stubs;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // attention chunks and probe tensors can be large
  // dns:///NAME:PORT of a headless Service resolves to every pod; spread calls over them.
  args.SetLoadBalancingPolicyName("round_robin");
  stubs.channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  stubs.generation = v1::Generation::NewStub(stubs.channel);
  stubs.interpret = std::shared_ptr<v1::Interpret::Stub>(v1::Interpret::NewStub(stubs.channel));
  return stubs;
}

#else  // !KVLENS_LOAD_INTERPRET

bool InterpretSupported() { return false; }

std::unique_ptr<Call> MakeInterpretCall(const ServerStubs&, const RequestSpec&,
                                        std::chrono::milliseconds) {
  return nullptr;
}

ServerStubs MakeStubs(const std::string& address) {
  ServerStubs stubs;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetLoadBalancingPolicyName("round_robin");
  stubs.channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  stubs.generation = v1::Generation::NewStub(stubs.channel);
  return stubs;
}

#endif  // KVLENS_LOAD_INTERPRET

}  // namespace kvlens::load
