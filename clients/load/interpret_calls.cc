// AttentionMaps / GradientProbe traffic. Compiled with KVLENS_LOAD_INTERPRET when
// kvlens_proto carries interpret.proto; without it the factories say "unsupported" and
// kvlens-load rejects --attention-share / --probe-share. A new interpretability kind is
// one more Call class here and one more Kind in workload.h.
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

// J = log p(last prompt token | the tokens before it) (text prompts: of token 0 after the
// first position); gradients w.r.t. the input embeddings and their saliency.
class ProbeCall final : public Call, public grpc::ClientUnaryReactor {
 public:
  ProbeCall(v1::Interpret::Stub* stub, const RequestSpec& spec, std::chrono::milliseconds timeout)
      : stub_(stub) {
    SetInput(spec, request_.mutable_input());
    v1::TokenTarget* target = request_.mutable_log_prob()->add_targets();
    const int n = static_cast<int>(spec.token_ids.size());
    target->set_position(n >= 2 ? n - 2 : 0);
    target->set_token(n >= 2 ? spec.token_ids[n - 1] : 0);
    request_.set_embeddings(true);
    context_.set_deadline(std::chrono::system_clock::now() + timeout);
    result_.kind = Kind::kProbe;
  }

  void Start(DoneFn done) override {
    done_ = std::move(done);
    start_ = Clock::now();
    stub_->async()->GradientProbe(&context_, &request_, &response_, this);
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
  v1::GradientProbeRequest request_;
  v1::GradientProbeResponse response_;
  grpc::ClientContext context_;
  DoneFn done_;
  Clock::time_point start_;
  CallResult result_;
};

}  // namespace

bool InterpretSupported() { return true; }

std::unique_ptr<Call> MakeInterpretCall(const ServerStubs& stubs, const RequestSpec& spec,
                                        std::chrono::milliseconds timeout) {
  auto* stub = static_cast<v1::Interpret::Stub*>(stubs.interpret.get());
  if (spec.kind == Kind::kAttention) return std::make_unique<AttentionCall>(stub, spec, timeout);
  if (spec.kind == Kind::kProbe) return std::make_unique<ProbeCall>(stub, spec, timeout);
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
