// kernels/cuda's parameter structs, field by field (emu_struct_pointers.h). Each is
// pinned to its size: a new pointer field makes its struct larger, and this file then fails
// to compile until the list is looked at again, so that the pointer is not left out of the
// rule unseen.
#include "tests/kernels/cuda/emu/emu_struct_pointers.h"

#include <type_traits>
#include <typeindex>
#include <unordered_map>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_backward.h"

namespace kvlens_emu {
namespace {

using kvlens::kernels::cuda::AttentionBackwardParams;
using kvlens::kernels::cuda::AttentionParams;

static_assert(std::is_standard_layout_v<AttentionParams> &&
              std::is_standard_layout_v<AttentionBackwardParams>);
static_assert(sizeof(AttentionParams) == 176,
              "AttentionParams changed: check its pointer fields in AttentionPointers");
static_assert(sizeof(AttentionBackwardParams) == 248,
              "AttentionBackwardParams changed: check its pointer fields in BackwardPointers");

#define KVLENS_EMU_FIELD(S, f, writes) \
  StructPointer { offsetof(S, f), #f, writes }

// AttentionParams's pointers, at `base` within a struct and named `prefix` + field: the
// attention kernels read everything but `out`.
std::vector<StructPointer> AttentionPointers(size_t base, const std::string& prefix) {
  std::vector<StructPointer> fields = {KVLENS_EMU_FIELD(AttentionParams, q, false),
                                       KVLENS_EMU_FIELD(AttentionParams, k, false),
                                       KVLENS_EMU_FIELD(AttentionParams, v, false),
                                       KVLENS_EMU_FIELD(AttentionParams, block_table, false),
                                       KVLENS_EMU_FIELD(AttentionParams, q_doc, false),
                                       KVLENS_EMU_FIELD(AttentionParams, k_doc, false),
                                       KVLENS_EMU_FIELD(AttentionParams, out, true),
                                       KVLENS_EMU_FIELD(AttentionParams, row_key_end, false),
                                       KVLENS_EMU_FIELD(AttentionParams, row_table_offset, false),
                                       KVLENS_EMU_FIELD(AttentionParams, flash_tiles, false)};
  for (StructPointer& f : fields) {
    f.offset += base;
    f.name = prefix + f.name;
  }
  return fields;
}

// The backward reads the forward's inputs (its `out` is unused: a read, should it be set),
// its probabilities and dO, and writes the rest.
std::vector<StructPointer> BackwardPointers() {
  std::vector<StructPointer> fields =
      AttentionPointers(offsetof(AttentionBackwardParams, fwd), "AttentionBackwardParams::fwd.");
  for (StructPointer& f : fields) f.writes = false;
  for (StructPointer f : {KVLENS_EMU_FIELD(AttentionBackwardParams, probs, false),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dout, false),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dq, true),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dk, true),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dv, true),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dprobs, true),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dscores, true),
                          KVLENS_EMU_FIELD(AttentionBackwardParams, dscores_raw, true)}) {
    f.name = "AttentionBackwardParams::" + f.name;
    fields.push_back(f);
  }
  return fields;
}

#undef KVLENS_EMU_FIELD

}  // namespace

const std::vector<StructPointer>* DeclaredPointers(const std::type_info& type) {
  static const auto* const declared =
      new std::unordered_map<std::type_index, std::vector<StructPointer>>{
          {typeid(AttentionParams), AttentionPointers(0, "AttentionParams::")},
          {typeid(AttentionBackwardParams), BackwardPointers()}};
  auto it = declared->find(type);
  return it == declared->end() ? nullptr : &it->second;
}

}  // namespace kvlens_emu
