#include <utility>

#include "clients/load/calls.h"

namespace kvlens::load {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class GenerateCall final : public Call, public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request,
               std::chrono::milliseconds timeout, bool keep_ids)
      : stub_(stub), request_(std::move(request)), keep_ids_(keep_ids) {
    context_.set_deadline(std::chrono::system_clock::now() + timeout);
  }

  void Start(DoneFn done) override {
    done_ = std::move(done);
    start_ = last_ = Clock::now();
    stub_->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void Cancel() override { context_.TryCancel(); }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended; OnDone follows
    const Clock::time_point now = Clock::now();
    result_.response_bytes += static_cast<int64_t>(response_.ByteSizeLong());
    const int k = response_.token_ids_size();
    if (k > 0) {
      if (result_.output_tokens == 0) {
        // Tokens after the first in the first chunk have no gap of their own to measure.
        result_.ttft_seconds = Seconds(now - start_);
      } else {
        const double gap = Seconds(now - last_) / k;
        for (int i = 0; i < k; ++i) result_.itl_seconds.push_back(gap);
      }
      result_.output_tokens += k;
      if (keep_ids_) {
        result_.output_ids.insert(result_.output_ids.end(), response_.token_ids().begin(),
                                  response_.token_ids().end());
      }
      last_ = now;
    }
    if (response_.has_final()) {
      result_.prompt_tokens = response_.final().usage().prompt_tokens();
      result_.cached_tokens = response_.final().usage().cached_tokens();
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    result_.e2e_seconds = Seconds(Clock::now() - start_);
    result_.code = status.error_code();
    if (!status.ok()) result_.message = status.error_message();
    done_(this, std::move(result_));  // last statement: the runner may destroy us after it
  }

 private:
  v1::Generation::Stub* stub_;
  v1::GenerateRequest request_;
  bool keep_ids_;
  grpc::ClientContext context_;
  v1::GenerateResponse response_;
  DoneFn done_;
  Clock::time_point start_, last_;
  CallResult result_;
};

}  // namespace

std::unique_ptr<Call> MakeGenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request,
                                       std::chrono::milliseconds timeout, bool keep_ids) {
  return std::make_unique<GenerateCall>(stub, std::move(request), timeout, keep_ids);
}

}  // namespace kvlens::load
