// The server's own tokenizer (Generation.Tokenize, Detokenize): `kvlens-cli tokenize
// --server`, the text of the tokens an Interpret command prints, and a token given as text
// rather than as an id (--target-text " Paris", as TransformerLens's to_single_token), which
// those commands must know before they send a request.
#ifndef KVLENS_CLIENTS_CLI_SERVER_TOKENS_H_
#define KVLENS_CLIENTS_CLI_SERVER_TOKENS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "clients/cli/args.h"
#include "kvlens/v1/generation.grpc.pb.h"

namespace kvlens::cli {

// The ids the server's tokenizer makes of `request` (`args` has --server and --timeout);
// `why` prefixes a failed call's message. INVALID_ARGUMENT naming a field that is not UTF-8.
absl::StatusOr<std::vector<int32_t>> ServerTokenize(const Args& args,
                                                    const v1::TokenizeRequest& request,
                                                    const std::string& why);

// The text of each token of `ids` alone, as the server detokenizes it (" the" for GPT-2's
// "Ġthe"), keyed by id: one Detokenize call a distinct id. A failed call's status.
absl::StatusOr<std::map<int32_t, std::string>> ServerTokenTexts(const Args& args,
                                                                const std::vector<int32_t>& ids);

// One token's text, as above, over `stub` with `context` (its deadline, if any).
absl::StatusOr<std::string> ServerTokenText(v1::Generation::Stub& stub,
                                            grpc::ClientContext& context, int32_t id);

// The token id of flag `id_flag` (an integer in [0, 2^30]; −1 too when not `required`)
// or of `text_flag`, whose text the server must encode as exactly one token (no BOS).
// Neither given: −1 when not `required`. INVALID_ARGUMENT naming the flags when both are
// given, neither of required ones, or text that is not one token (its ids listed).
absl::StatusOr<int32_t> TokenFlag(const Args& args, const std::string& id_flag,
                                  const std::string& text_flag, bool required);

// The one token the server's tokenizer makes of `text` (no BOS); INVALID_ARGUMENT naming
// `what` and ending with `hint` when it is not one token (its ids listed).
absl::StatusOr<int32_t> ServerOneToken(const Args& args, const std::string& text,
                                       const std::string& what, const std::string& hint);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_SERVER_TOKENS_H_
