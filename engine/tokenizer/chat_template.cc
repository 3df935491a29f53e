#include "engine/tokenizer/chat_template.h"

#include <array>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvlens {
namespace {

constexpr std::array<std::pair<ChatFormat, std::string_view>, 19> kNames = {{
    {ChatFormat::kChatMl, "chatml"},
    {ChatFormat::kLlama3, "llama3"},
    {ChatFormat::kLlama2, "llama2"},
    {ChatFormat::kLlama2Sys, "llama2-sys"},
    {ChatFormat::kLlama2SysBos, "llama2-sys-bos"},
    {ChatFormat::kLlama2SysStrip, "llama2-sys-strip"},
    {ChatFormat::kMistralV1, "mistral-v1"},
    {ChatFormat::kMistralV3, "mistral-v3"},
    {ChatFormat::kMistralV3Tekken, "mistral-v3-tekken"},
    {ChatFormat::kMistralV7, "mistral-v7"},
    {ChatFormat::kPhi3, "phi3"},
    {ChatFormat::kPhi4, "phi4"},
    {ChatFormat::kGemma, "gemma"},
    {ChatFormat::kCommandR, "command-r"},
    {ChatFormat::kDeepSeek2, "deepseek2"},
    {ChatFormat::kDeepSeekCoder, "deepseek-coder"},
    {ChatFormat::kVicuna, "vicuna"},
    {ChatFormat::kVicunaOrca, "vicuna-orca"},
    {ChatFormat::kMiniCpm, "minicpm"},
}};

bool Has(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

std::string Trim(const std::string& s) {
  absl::string_view v(s);
  return std::string(absl::StripAsciiWhitespace(v));
}

// The [INST] families: a turn opens with `open`, the system message (held until the next
// user message, or inside the turn for the llama2 ones) is wrapped in sys_open … sys_close,
// a user message ends with `user_close`, an assistant message is `before_answer` + content +
// </s>, and `bos_between` goes before every turn after the first.
struct InstStyle {
  const char* open;
  const char* sys_open;
  const char* sys_close;
  const char* user_close;
  const char* before_answer;
  const char* bos_between;
  bool system_in_turn;  // llama2: the system text opens the first turn itself
  bool strip, strip_answer;
};

InstStyle StyleOf(ChatFormat f) {
  switch (f) {
    case ChatFormat::kLlama2:
      return {"[INST] ", "", "\n", " [/INST]", "", "", true, false, false};
    case ChatFormat::kLlama2Sys:
      return {"[INST] ", "<<SYS>>\n", "\n<</SYS>>\n\n", " [/INST]", "", "", true, false, false};
    case ChatFormat::kLlama2SysBos:
      return {"[INST] ", "<<SYS>>\n", "\n<</SYS>>\n\n", " [/INST]", "", "<s>", true, false, false};
    case ChatFormat::kLlama2SysStrip:
      return {"[INST] ", "<<SYS>>\n", "\n<</SYS>>\n\n", " [/INST]", "", "", true, true, true};
    case ChatFormat::kMistralV1:
      return {" [INST] ", "", "\n\n", " [/INST]", " ", "", false, false, false};
    case ChatFormat::kMistralV3:
      return {"[INST] ", "", "\n\n", "[/INST]", " ", "", false, false, true};
    default:  // kMistralV3Tekken
      return {"[INST]", "", "\n\n", "[/INST]", "", "", false, false, false};
  }
}

std::string ApplyInst(ChatFormat f, std::span<const ChatMessage> messages) {
  const InstStyle st = StyleOf(f);
  auto text = [&](const std::string& c) { return st.strip ? Trim(c) : c; };
  std::string out, pending_system;
  bool in_turn = false, first_turn = true;
  auto open_turn = [&] {
    if (in_turn) return;
    if (!first_turn) out += st.bos_between;
    out += st.open;
    in_turn = true;
    first_turn = false;
  };
  for (const ChatMessage& m : messages) {
    if (m.role == "system") {
      if (st.system_in_turn) {
        open_turn();
        absl::StrAppend(&out, st.sys_open, text(m.content), st.sys_close);
      } else {
        absl::StrAppend(&pending_system, m.content, st.sys_close);
      }
    } else if (m.role == "user") {
      open_turn();
      absl::StrAppend(&out, pending_system, text(m.content), st.user_close);
      pending_system.clear();
    } else {
      absl::StrAppend(&out, st.before_answer, st.strip_answer ? Trim(m.content) : m.content,
                      "</s>");
      in_turn = false;
    }
  }
  if (!pending_system.empty()) {  // a system message with no user message after it
    open_turn();
    absl::StrAppend(&out, pending_system, st.user_close);
  }
  return out;
}

// One message as the simpler formats write it.
std::string Message(ChatFormat f, const ChatMessage& m) {
  const std::string& c = m.content;
  const bool sys = m.role == "system", user = m.role == "user";
  switch (f) {
    case ChatFormat::kChatMl:
      return absl::StrCat("<|im_start|>", m.role, "\n", c, "<|im_end|>\n");
    case ChatFormat::kLlama3:
      return absl::StrCat("<|start_header_id|>", m.role, "<|end_header_id|>\n\n", Trim(c),
                          "<|eot_id|>");
    case ChatFormat::kPhi3:
      return absl::StrCat("<|", m.role, "|>\n", c, "<|end|>\n");
    case ChatFormat::kPhi4:
      return absl::StrCat("<|im_start|>", m.role, "<|im_sep|>", c, "<|im_end|>");
    case ChatFormat::kMistralV7:
      return sys    ? absl::StrCat("[SYSTEM_PROMPT] ", c, "[/SYSTEM_PROMPT]")
             : user ? absl::StrCat("[INST] ", c, "[/INST]")
                    : absl::StrCat(" ", c, "</s>");
    case ChatFormat::kCommandR:
      return absl::StrCat("<|START_OF_TURN_TOKEN|>",
                          sys    ? "<|SYSTEM_TOKEN|>"
                          : user ? "<|USER_TOKEN|>"
                                 : "<|CHATBOT_TOKEN|>",
                          Trim(c), "<|END_OF_TURN_TOKEN|>");
    case ChatFormat::kDeepSeek2:
      return sys    ? absl::StrCat(c, "\n\n")
             : user ? absl::StrCat("User: ", c, "\n\n")
                    : absl::StrCat("Assistant: ", c,
                                   "<\xEF\xBD\x9C"
                                   "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>");
    case ChatFormat::kDeepSeekCoder:
      return sys    ? c
             : user ? absl::StrCat("### Instruction:\n", c, "\n")
                    : absl::StrCat("### Response:\n", c, "\n<|EOT|>\n");
    case ChatFormat::kVicuna:
    case ChatFormat::kVicunaOrca:
      return sys    ? (f == ChatFormat::kVicuna ? absl::StrCat(c, "\n\n")
                                                : absl::StrCat("SYSTEM: ", c, "\n"))
             : user ? absl::StrCat("USER: ", c, "\n")
                    : absl::StrCat("ASSISTANT: ", c, "</s>\n");
    case ChatFormat::kMiniCpm:  // <用户> … <AI>
      return user ? absl::StrCat("<\xE7\x94\xA8\xE6\x88\xB7>", Trim(c), "<AI>") : Trim(c);
    default:
      return "";
  }
}

// What the assistant's turn opens with.
const char* GenerationPrompt(ChatFormat f) {
  switch (f) {
    case ChatFormat::kChatMl:
      return "<|im_start|>assistant\n";
    case ChatFormat::kLlama3:
      return "<|start_header_id|>assistant<|end_header_id|>\n\n";
    case ChatFormat::kPhi3:
      return "<|assistant|>\n";
    case ChatFormat::kPhi4:
      return "<|im_start|>assistant<|im_sep|>";
    case ChatFormat::kGemma:
      return "<start_of_turn>model\n";
    case ChatFormat::kCommandR:
      return "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>";
    case ChatFormat::kDeepSeek2:
      return "Assistant:";
    case ChatFormat::kDeepSeekCoder:
      return "### Response:\n";
    case ChatFormat::kVicuna:
    case ChatFormat::kVicunaOrca:
      return "ASSISTANT:";
    default:  // the [INST] families: a user turn ends with [/INST]
      return "";
  }
}

}  // namespace

std::string_view ChatFormatName(ChatFormat format) {
  for (const auto& [f, name] : kNames) {
    if (f == format) return name;
  }
  return "";
}

std::string ChatFormatNames() {
  std::string names;
  for (const auto& [f, name] : kNames) {
    if (!names.empty()) names += ", ";
    names += name;
  }
  return names;
}

absl::StatusOr<ChatFormat> ChatFormatByName(std::string_view name) {
  for (const auto& [f, n] : kNames) {
    if (n == name) return f;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("chat template \"", std::string(name), "\" is not one of ", ChatFormatNames()));
}

absl::StatusOr<ChatFormat> DetectChatFormat(std::string_view t) {
  // Most specific first: phi4 also has <|im_start|>, the Mistral templates all have [INST].
  if (Has(t, "<|im_sep|>")) return ChatFormat::kPhi4;
  if (Has(t, "<|im_start|>")) return ChatFormat::kChatMl;
  if (Has(t, "<|start_header_id|>") && Has(t, "<|end_header_id|>")) return ChatFormat::kLlama3;
  if (Has(t, "[SYSTEM_PROMPT]")) return ChatFormat::kMistralV7;
  if (Has(t, "<|START_OF_TURN_TOKEN|>")) return ChatFormat::kCommandR;
  if (Has(t, "<start_of_turn>")) return ChatFormat::kGemma;
  if (Has(t, "<|assistant|>") && Has(t, "<|end|>")) return ChatFormat::kPhi3;
  if (Has(t, "' [INST] ' + system_message")) return ChatFormat::kMistralV1;
  if (Has(t, "\"[INST]\" + system_message") || Has(t, "'[INST]' + system_message")) {
    return ChatFormat::kMistralV3Tekken;
  }
  if (Has(t, "\"[INST] \" + system_message") || Has(t, "'[INST] ' + system_message")) {
    return ChatFormat::kMistralV3;
  }
  if (Has(t, "[INST]")) {
    if (!Has(t, "<<SYS>>")) return ChatFormat::kLlama2;
    if (Has(t, "bos_token + '[INST]")) return ChatFormat::kLlama2SysBos;
    if (Has(t, "content.strip()")) return ChatFormat::kLlama2SysStrip;
    return ChatFormat::kLlama2Sys;
  }
  if (Has(t, "'Assistant: ' + message['content'] + eos_token")) return ChatFormat::kDeepSeek2;
  if (Has(t, "### Instruction:") && Has(t, "<|EOT|>")) return ChatFormat::kDeepSeekCoder;
  if (Has(t, "<\xE7\x94\xA8\xE6\x88\xB7>")) return ChatFormat::kMiniCpm;  // <用户>
  if (Has(t, "USER: ") && Has(t, "ASSISTANT: ")) {
    return Has(t, "SYSTEM: ") ? ChatFormat::kVicunaOrca : ChatFormat::kVicuna;
  }
  return absl::NotFoundError(t.empty() ? "the model has no chat template"
                                       : "the model's chat template is not one kvlens knows");
}

absl::StatusOr<std::string> ApplyChatTemplate(ChatFormat format,
                                              std::span<const ChatMessage> messages,
                                              bool add_generation_prompt) {
  if (messages.empty()) return absl::InvalidArgumentError("messages: at least one is needed");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    if (r != "system" && r != "user" && r != "assistant") {
      return absl::InvalidArgumentError(absl::StrCat("messages[", i, "].role: \"", r,
                                                     "\" is not one of system, user, assistant"));
    }
  }
  std::string out;
  switch (format) {
    case ChatFormat::kLlama2:
    case ChatFormat::kLlama2Sys:
    case ChatFormat::kLlama2SysBos:
    case ChatFormat::kLlama2SysStrip:
    case ChatFormat::kMistralV1:
    case ChatFormat::kMistralV3:
    case ChatFormat::kMistralV3Tekken:
      out = ApplyInst(format, messages);
      break;
    case ChatFormat::kGemma: {
      // No system role: its text opens the next user message, a blank line after it.
      std::string system;
      for (const ChatMessage& m : messages) {
        if (m.role == "system") {
          absl::StrAppend(&system, Trim(m.content), "\n\n");
          continue;
        }
        absl::StrAppend(&out, "<start_of_turn>", m.role == "user" ? "user" : "model", "\n",
                        m.role == "user" ? system : "", Trim(m.content), "<end_of_turn>\n");
        if (m.role == "user") system.clear();
      }
      if (!system.empty())
        absl::StrAppend(&out, "<start_of_turn>user\n", system, "<end_of_turn>\n");
      break;
    }
    default:
      for (const ChatMessage& m : messages) out += Message(format, m);
  }
  if (add_generation_prompt) out += GenerationPrompt(format);
  return out;
}

}  // namespace kvlens
