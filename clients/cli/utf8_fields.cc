#include "clients/cli/utf8_fields.h"

#include <google/protobuf/descriptor.h>

#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/tokenizer/unicode.h"

namespace kvlens::cli {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

absl::Status CheckString(const std::string& path, std::string_view s) {
  const size_t bad = unicode::FindInvalidUtf8(s);
  if (bad == std::string_view::npos) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrFormat(
      "%s is not valid UTF-8: byte 0x%02x at offset %d (gRPC carries text as UTF-8)", path,
      static_cast<unsigned char>(s[bad]), bad));
}

absl::Status Check(const Message& m, const std::string& prefix) {
  const Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);  // the fields set (repeated: non-empty)
  for (const FieldDescriptor* f : fields) {
    const std::string name = prefix + f->name();
    const bool is_string = f->type() == FieldDescriptor::TYPE_STRING;
    const bool is_message = f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE;
    if (!is_string && !is_message) continue;
    if (!f->is_repeated()) {
      const absl::Status s = is_string ? CheckString(name, r->GetString(m, f))
                                       : Check(r->GetMessage(m, f), name + ".");
      if (!s.ok()) return s;
      continue;
    }
    for (int i = 0; i < r->FieldSize(m, f); ++i) {
      const std::string item = absl::StrCat(name, "[", i, "]");
      const absl::Status s = is_string ? CheckString(item, r->GetRepeatedString(m, f, i))
                                       : Check(r->GetRepeatedMessage(m, f, i), item + ".");
      if (!s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckUtf8Fields(const Message& request) { return Check(request, ""); }

}  // namespace kvlens::cli
