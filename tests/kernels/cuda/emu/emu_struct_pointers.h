// The device pointers that kernels/cuda's parameter structs carry, for the CUDA emulator's
// stream-order rule (emu_runtime.cc, Pending): a kernel argument of class type is checked
// and accessed through its pointer fields as a pointer argument is. A struct declared
// here (emu_struct_pointers.cc) says which fields are pointers and which of them the
// kernels write through; for any other struct the emulator takes every 8-byte-aligned
// word that points into device memory as a pointer written through.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_STRUCT_POINTERS_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_STRUCT_POINTERS_H_

#include <cstddef>
#include <string>
#include <typeinfo>
#include <vector>

namespace kvlens_emu {

struct StructPointer {
  size_t offset;     // of the pointer within the struct
  std::string name;  // "AttentionParams::out"
  bool writes;       // whether a kernel writes through it
};

// The pointer fields of a declared parameter struct, or null for any other type (the list
// lives as long as the process).
const std::vector<StructPointer>* DeclaredPointers(const std::type_info& type);

}  // namespace kvlens_emu

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_STRUCT_POINTERS_H_
