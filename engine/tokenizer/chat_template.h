// Chat templates: a conversation (system, user and assistant messages) as the prompt text an
// instruct model was trained on. Models ship their template as Jinja (GGUF
// tokenizer.chat_template, tokenizer_config.json's chat_template); kvlens does not run
// Jinja. Like llama.cpp's built-in templates, it recognises the common families by
// substrings of the Jinja source (DetectChatFormat) and writes each family's format in
// code (ApplyChatTemplate), with llama.cpp's output for its test conversation as the
// reference (tests/engine/tokenizer/chat_template_test.cc). A model whose template is none
// of them has no chat format: a server can name one (--chat-template), or the client sends
// text.
//
// The text never starts with BOS: the tokenizer adds it (Tokenizer::adds_bos), as it does
// for a text prompt. Special-token spellings in it (<|im_start|>, [INST], …) are meant to be
// encoded as special tokens (parse_special).
#ifndef KVLENS_ENGINE_TOKENIZER_CHAT_TEMPLATE_H_
#define KVLENS_ENGINE_TOKENIZER_CHAT_TEMPLATE_H_

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace kvlens {

enum class ChatFormat {
  kChatMl,           // <|im_start|>role … <|im_end|> (Qwen, Hermes, Yi, …)
  kLlama3,           // <|start_header_id|>role<|end_header_id|> … <|eot_id|>
  kLlama2,           // [INST] … [/INST] (Mistral v0.1/v0.2 without <<SYS>>)
  kLlama2Sys,        // [INST] <<SYS>> … <</SYS>> … [/INST]
  kLlama2SysBos,     //   and BOS text before each later [INST]
  kLlama2SysStrip,   //   and every message stripped
  kMistralV1,        //  [INST] … [/INST] with leading spaces
  kMistralV3,        // [INST] … [/INST] (Mistral Large 2407)
  kMistralV3Tekken,  // [INST]…[/INST] without spaces (Mistral Nemo)
  kMistralV7,        // [SYSTEM_PROMPT] … [/SYSTEM_PROMPT][INST] … [/INST]
  kPhi3,             // <|role|>\n … <|end|>
  kPhi4,             // <|im_start|>role<|im_sep|> … <|im_end|>
  kGemma,            // <start_of_turn>user|model … <end_of_turn> (system folded into user)
  kCommandR,         // <|START_OF_TURN_TOKEN|><|USER_TOKEN|> … <|END_OF_TURN_TOKEN|>
  kDeepSeek2,        // User: … \n\nAssistant: …<｜end▁of▁sentence｜>
  kDeepSeekCoder,    // ### Instruction:\n … ### Response:\n … <|EOT|>
  kVicuna,           // USER: … ASSISTANT: …</s>
  kVicunaOrca,       //   with SYSTEM: for the system message
  kMiniCpm,          // <用户> … <AI> …
};

// The format's name as --chat-template and GetModelInfo spell it ("chatml", "llama3", …).
std::string_view ChatFormatName(ChatFormat format);
// The format named `name`; INVALID_ARGUMENT naming the known ones otherwise.
absl::StatusOr<ChatFormat> ChatFormatByName(std::string_view name);
// Every format's name, comma-separated (for flag help and errors).
std::string ChatFormatNames();

// The format whose family `jinja` (a model's Jinja chat template) belongs to; NOT_FOUND when
// none matches (also for an empty template).
absl::StatusOr<ChatFormat> DetectChatFormat(std::string_view jinja);

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// The conversation as `format` writes it, then the assistant's opening when
// add_generation_prompt (the formats whose user turn already ends in it add nothing).
// INVALID_ARGUMENT for no messages or a role other than system, user and assistant (naming
// the message's index).
absl::StatusOr<std::string> ApplyChatTemplate(ChatFormat format,
                                              std::span<const ChatMessage> messages,
                                              bool add_generation_prompt);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_CHAT_TEMPLATE_H_
