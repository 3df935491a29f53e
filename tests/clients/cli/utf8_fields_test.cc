// CheckUtf8Fields on requests built by hand: the byte sequences UTF-8 forbids (RFC 3629:
// a stray continuation byte, a truncated sequence, an overlong form, a surrogate, a code
// point past U+10FFFF) are refused with the field's path and the offending byte's offset;
// every well-formed length (1 to 4 bytes) passes, as do bytes fields.
#include "clients/cli/utf8_fields.h"

#include <string>

#include "gtest/gtest.h"
#include "kvlens/v1/generation.pb.h"
#include "kvlens/v1/interpret.pb.h"

namespace kvlens::cli {
namespace {

TEST(CheckUtf8Fields, WellFormedTextOfEveryLengthPasses) {
  v1::GenerateRequest r;
  r.set_text("a \xc3\xa9 \xe2\x9c\x93 \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf");  // é ✓ 😀 U+10FFFF
  r.mutable_stopping()->add_stop("\xe2\x80\x94");
  r.mutable_steering()->Add()->set_hook("blocks.0.hook_resid_pre");
  EXPECT_TRUE(CheckUtf8Fields(r).ok());
  EXPECT_TRUE(CheckUtf8Fields(v1::GenerateRequest()).ok());
}

TEST(CheckUtf8Fields, EachForbiddenSequenceIsNamedWithItsFieldAndOffset) {
  struct Case {
    std::string text;
    std::string message;
  };
  const Case cases[] = {
      {"ab\x80", "text is not valid UTF-8: byte 0x80 at offset 2"},            // continuation
      {"ab\xe2\x9c", "text is not valid UTF-8: byte 0xe2 at offset 2"},        // truncated
      {"\xc0\xaf", "text is not valid UTF-8: byte 0xc0 at offset 0"},          // overlong '/'
      {"x\xed\xa0\x80", "text is not valid UTF-8: byte 0xed at offset 1"},     // U+D800
      {"\xf4\x90\x80\x80", "text is not valid UTF-8: byte 0xf4 at offset 0"},  // U+110000
      {"\xff", "text is not valid UTF-8: byte 0xff at offset 0"},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r;
    r.set_text(c.text);
    const absl::Status s = CheckUtf8Fields(r);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(std::string(s.message()).rfind(c.message, 0), 0u) << s.message();
  }
}

TEST(CheckUtf8Fields, NestedAndRepeatedFieldsAreNamedByTheirPath) {
  v1::GenerateRequest r;
  r.mutable_stopping()->add_stop("fine");
  r.mutable_stopping()->add_stop("bad\xff");
  EXPECT_EQ(CheckUtf8Fields(r).message().substr(0, 47),
            "stopping.stop[1] is not valid UTF-8: byte 0xff ");
  v1::GenerateRequest chat;
  chat.mutable_chat()->add_messages()->set_content("hello");
  chat.mutable_chat()->add_messages()->set_content("\xc3");
  EXPECT_EQ(CheckUtf8Fields(chat).message().substr(0, 51),
            "chat.messages[1].content is not valid UTF-8: byte 0");
  v1::GradientProbeRequest probe;
  probe.mutable_input()->set_text("\xfe");
  EXPECT_EQ(CheckUtf8Fields(probe).message().substr(0, 36), "input.text is not valid UTF-8: byte ");
}

TEST(CheckUtf8Fields, BytesFieldsAreNotText) {
  v1::Tensor t;  // its data is raw little-endian numbers
  t.set_data(std::string("\xff\xfe\x00\x80", 4));
  EXPECT_TRUE(CheckUtf8Fields(t).ok());
}

}  // namespace
}  // namespace kvlens::cli
