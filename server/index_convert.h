// Indices in requests as Python (and TransformerLens) write them: on an axis of n entries
// (a sequence's positions, a model's layers or heads) an index is 0 … n−1, or counted from
// the end, −1 … −n (−1 the last). Everything a request indexes goes through here, so every
// field takes both forms and every refusal reads alike: the field, its value and [−n, n).
// Responses carry the resolved, non-negative indices.
#ifndef KVLENS_SERVER_INDEX_CONVERT_H_
#define KVLENS_SERVER_INDEX_CONVERT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"

namespace kvlens::server {

// `value` in [−n, n) → 0 … n−1; anything else is INVALID_ARGUMENT naming `field`.
absl::StatusOr<int> ToIndex(int64_t value, int64_t n, const std::string& field);

// Each of `ids` through ToIndex (field "field[k]"), none twice (an index given once from
// each end is repeated too); in the given order. Empty: 0 … n−1.
absl::StatusOr<std::vector<int>> ToIndexList(const google::protobuf::RepeatedField<int32_t>& ids,
                                             int n, const std::string& field);

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_INDEX_CONVERT_H_
