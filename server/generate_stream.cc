#include "server/generate_stream.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "server/request_convert.h"
#include "server/status_util.h"

namespace kvlens::server {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

GenerateStream::GenerateStream(GenerationService& service, Clock::time_point arrival)
    : service_(service), arrival_(arrival) {}

void GenerateStream::Start(const v1::GenerateRequest& request) {
  absl::StatusOr<GenerationRequest> converted =
      service_.draining()
          ? absl::UnavailableError("the server is shutting down")
          : ToGenerationRequest(request, service_.engine().model(), service_.saes());
  if (converted.ok()) {
    with_logprobs_ = request.logprobs() || request.top_logprobs() > 0;
    attention_rows_ = converted->attention_rows;
    if (converted->prompt_logprobs >= 0) {
      converted->callbacks.on_prompt_logprobs = [this](const PromptLogprobsEvent& e) {
        OnEnginePromptLogprobs(e);
      };
    }
    converted->callbacks.on_token = [this](const TokenEvent& e) { OnEngineToken(e); };
    converted->callbacks.on_finish = [this](const FinishEvent& e) { OnEngineFinish(e); };
    // The engine's reference, and one for this function: the engine may finish the request
    // (and gRPC the call) before Submit even returns.
    refs_.fetch_add(2);
    absl::StatusOr<RequestId> id = service_.engine().Submit(std::move(*converted));
    if (id.ok()) {
      bool cancel = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        id_ = *id;
        submitted_ = true;
        if (!finish_.has_value()) service_.AddActive(id_);
        cancel = client_cancelled_ && !finish_.has_value();
      }
      if (cancel) service_.engine().Cancel(*id);
      TryWrite();
      Unref();
      return;
    }
    // A rejected request never gets callbacks, so the engine's reference goes now.
    refs_.fetch_sub(2);
    converted = id.status();
  }
  const grpc::Status status = ToGrpcStatus(converted.status());
  {
    std::lock_guard<std::mutex> lock(mu_);
    RecordFinish(status);
  }
  Finish(status);
}

void GenerateStream::OnEnginePromptLogprobs(const PromptLogprobsEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    prompt_logprobs_.push_back(event);
  }
  TryWrite();
}

void GenerateStream::OnEngineToken(const TokenEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    tokens_.push_back(event);
  }
  TryWrite();
}

void GenerateStream::OnEngineFinish(const FinishEvent& event) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    finish_ = event;
    if (submitted_) service_.RemoveActive(id_);
  }
  TryWrite();
  Unref();
}

void GenerateStream::TryWrite() {
  enum class Op { kNone, kWrite, kWriteAndFinish, kFinish } op = Op::kNone;
  grpc::Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (writing_ || finish_called_ || (!submitted_ && !client_cancelled_)) return;
    if (client_cancelled_) {
      status = grpc::Status(grpc::StatusCode::CANCELLED, "the client cancelled the call");
      op = Op::kFinish;
    } else {
      message_.Clear();
      message_.set_request_id(id_);
      bool has_output = !prompt_logprobs_.empty();
      for (size_t room = kPromptLogprobsPerMessage; room > 0 && !prompt_logprobs_.empty();) {
        const PromptLogprobsEvent& e = prompt_logprobs_.front();
        const size_t take = std::min(room, e.tokens.size() - prompt_done_);
        ToProto(e, prompt_done_, prompt_done_ + take, &message_);
        room -= take;
        prompt_done_ += take;
        if (prompt_done_ == e.tokens.size()) {
          prompt_logprobs_.pop_front();
          prompt_done_ = 0;
        }
      }
      // Tokens (and the end) wait for the prompt's log-probabilities to be written.
      const bool prompt_pending = !prompt_logprobs_.empty();
      has_output = has_output || (!prompt_pending && !tokens_.empty());
      if (!prompt_pending) {
        for (const TokenEvent& e : tokens_) {
          if (!first_token_seen_) {
            service_.metrics().RecordTimeToFirstToken(Seconds(e.time - arrival_));
            first_token_seen_ = true;
          } else {
            service_.metrics().RecordInterTokenLatency(Seconds(e.time - last_token_time_));
          }
          last_token_time_ = e.time;
          ToProto(e, with_logprobs_, attention_rows_, &message_);
        }
        tokens_.clear();
      }
      if (prompt_pending) {
        op = Op::kWrite;
      } else if (finish_.has_value() && finish_->reason == FinishReason::kError) {
        // Tokens already generated still go out; then the error ends the stream.
        if (has_output) {
          op = Op::kWrite;
        } else {
          status = finish_->status.ok()
                       ? grpc::Status(grpc::StatusCode::INTERNAL, "generation failed")
                       : ToGrpcStatus(finish_->status);
          op = Op::kFinish;
        }
      } else if (finish_.has_value()) {
        message_.mutable_text()->append(finish_->text);
        ToProto(*finish_, message_.mutable_final());
        op = Op::kWriteAndFinish;
      } else if (has_output || !header_sent_) {
        op = Op::kWrite;  // the first message goes out at once: it carries the request id
      }
    }
    if (op == Op::kWrite) {
      writing_ = true;
      header_sent_ = true;
    } else if (op != Op::kNone) {
      RecordFinish(status);
    }
  }
  switch (op) {
    case Op::kNone:
      break;
    case Op::kWrite:
      StartWrite(&message_);
      break;
    case Op::kWriteAndFinish:
      StartWriteAndFinish(&message_, grpc::WriteOptions(), status);
      break;
    case Op::kFinish:
      Finish(status);
      break;
  }
}

void GenerateStream::RecordFinish(const grpc::Status& status) {
  finish_called_ = true;
  Metrics& m = service_.metrics();
  m.RecordRpc("Generate", status.error_code());
  if (!submitted_) return;  // rejected: no request-level metrics
  m.RecordRequestDuration(Seconds(Clock::now() - arrival_));
  if (finish_.has_value()) {
    m.RecordTokens(finish_->usage.prompt_tokens, finish_->usage.generated_tokens);
    // A request cancelled while waiting was never scheduled: it has no queue time.
    if (finish_->reason != FinishReason::kCancelled || finish_->usage.generated_tokens > 0) {
      m.RecordQueueDuration(finish_->timings.queue_seconds);
    }
  }
}

void GenerateStream::OnWriteDone(bool ok) {
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_ = false;
    if (!ok && !client_cancelled_) {
      // The transport is gone (OnCancel usually follows): stop generating now.
      client_cancelled_ = true;
      cancel = submitted_ && !finish_.has_value();
    }
  }
  if (cancel) service_.engine().Cancel(id_);
  TryWrite();
}

void GenerateStream::OnCancel() {
  bool cancel = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!client_cancelled_) {
      client_cancelled_ = true;
      cancel = submitted_ && !finish_.has_value();
    }
  }
  // Frees the request's KV blocks at once rather than when max_new_tokens runs out.
  if (cancel) service_.engine().Cancel(id_);
  TryWrite();
}

void GenerateStream::OnDone() { Unref(); }

void GenerateStream::Unref() {
  if (refs_.fetch_sub(1) == 1) delete this;
}

}  // namespace kvlens::server
