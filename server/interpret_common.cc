#include "server/interpret_common.h"

namespace kvlens::server {

// The sequence of `input`: text, ids, or (when allowed) an open session's tokens.
absl::StatusOr<SequenceSpec> Resolve(const InterpContext& ctx, const v1::PromptInput& input,
                                     const std::string& field, bool allow_session) {
  if (input.prompt_case() != v1::PromptInput::kSessionId || !allow_session) {
    return ToSequence(input, ctx.model(), ctx.limits, field);
  }
  std::vector<int32_t> tokens;
  if (absl::Status s = ctx.engine.ReadSession(
          input.session_id(),
          [&](const Engine::SessionView& v) { tokens.assign(v.tokens.begin(), v.tokens.end()); });
      !s.ok()) {
    return s;
  }
  return ToSequence(input, ctx.model(), ctx.limits, field, &tokens);
}

}  // namespace kvlens::server
