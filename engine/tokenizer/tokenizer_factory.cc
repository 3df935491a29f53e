#include "engine/tokenizer/tokenizer_factory.h"

#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "engine/model/mapped_file.h"
#include "engine/tokenizer/gpt2_tokenizer.h"
#include "engine/tokenizer/spm_tokenizer.h"

namespace kvlens {

namespace {

// absl here is built with its own string_view type, which StrCat takes.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr char kModelKey[] = "tokenizer.ggml.model";
constexpr char kPreKey[] = "tokenizer.ggml.pre";  // the pre-tokenizer of a "gpt2" model
constexpr char kAddBosKey[] = "tokenizer.ggml.add_bos_token";
constexpr char kTokensKey[] = "tokenizer.ggml.tokens";
constexpr char kScoresKey[] = "tokenizer.ggml.scores";
constexpr char kTypesKey[] = "tokenizer.ggml.token_type";
// llama2.c vocabularies have pieces of a few dozen bytes; anything huge is garbage.
constexpr int32_t kMaxLlama2cTokenLength = 1 << 16;
constexpr char kMergesKey[] = "tokenizer.ggml.merges";

// A token id that may be absent (-1), else must be inside the vocabulary.
absl::StatusOr<int32_t> OptionalId(const GgufFile& gguf, const char* key, size_t n) {
  if (gguf.Find(key) == nullptr) return -1;
  auto v = gguf.GetInt(key);
  if (!v.ok()) return v.status();
  if (*v < 0 || static_cast<uint64_t>(*v) >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat(gguf.path(), ": ", key, " = ", *v, " is outside the vocabulary of ", n));
  }
  return static_cast<int32_t>(*v);
}

absl::StatusOr<std::vector<TokenType>> TokenTypes(const GgufFile& gguf, size_t n) {
  if (gguf.Find(kTypesKey) == nullptr) return std::vector<TokenType>(n, TokenType::kNormal);
  auto raw = gguf.GetIntArray(kTypesKey);
  if (!raw.ok()) return raw.status();
  if (raw->size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(gguf.path(), ": ", kTypesKey, " has ",
                                                   raw->size(), " entries but ", kTokensKey,
                                                   " has ", n));
  }
  std::vector<TokenType> types(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t t = (*raw)[i];
    if (t < static_cast<int64_t>(TokenType::kNormal) ||
        t > static_cast<int64_t>(TokenType::kByte)) {
      return absl::InvalidArgumentError(
          absl::StrCat(gguf.path(), ": ", kTypesKey, "[", i, "] = ", t, " is not 1…6"));
    }
    types[i] = static_cast<TokenType>(t);
  }
  return types;
}

std::vector<std::string> ToStrings(absl::Span<const std::string_view> views) {
  return std::vector<std::string>(views.begin(), views.end());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufFile& gguf) {
  if (gguf.Find(kModelKey) == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(gguf.path(), ": no tokenizer (", kModelKey, " is missing)"));
  }
  auto model = gguf.GetString(kModelKey);
  if (!model.ok()) return model.status();
  auto tokens = gguf.GetStringArray(kTokensKey);
  if (!tokens.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer: ", tokens.status().message()));
  }
  const size_t n = tokens->size();
  auto types = TokenTypes(gguf, n);
  if (!types.ok()) return types.status();
  auto bos = OptionalId(gguf, "tokenizer.ggml.bos_token_id", n);
  if (!bos.ok()) return bos.status();
  auto eos = OptionalId(gguf, "tokenizer.ggml.eos_token_id", n);
  if (!eos.ok()) return eos.status();

  auto finish = [&](std::unique_ptr<Tokenizer> tok) -> absl::StatusOr<std::unique_ptr<Tokenizer>> {
    if (gguf.Find(kAddBosKey) != nullptr) {
      auto add = gguf.GetBool(kAddBosKey);
      if (!add.ok()) return add.status();
      tok->set_adds_bos(*add);
    }
    if (gguf.Find("tokenizer.chat_template") != nullptr) {
      auto tmpl = gguf.GetString("tokenizer.chat_template");
      if (!tmpl.ok()) return tmpl.status();
      tok->set_chat_template(std::string(*tmpl));
    }
    for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
      auto id = OptionalId(gguf, key, n);
      if (!id.ok()) return id.status();
      if (*id >= 0) tok->AddEndOfGeneration(*id);
    }
    return tok;
  };
  if (*model == "llama") {
    SpmTokenizer::Vocab v;
    auto scores = gguf.GetFloatArray(kScoresKey);
    if (!scores.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer: ", scores.status().message()));
    }
    if (scores->size() != n) {
      return absl::InvalidArgumentError(absl::StrCat(gguf.path(), ": ", kScoresKey, " has ",
                                                     scores->size(), " entries but ", kTokensKey,
                                                     " has ", n));
    }
    auto unk = OptionalId(gguf, "tokenizer.ggml.unknown_token_id", n);
    if (!unk.ok()) return unk.status();
    if (gguf.Find("tokenizer.ggml.add_space_prefix") != nullptr) {
      auto add = gguf.GetBool("tokenizer.ggml.add_space_prefix");
      if (!add.ok()) return add.status();
      v.add_space_prefix = *add;
    }
    v.pieces = ToStrings(*tokens);
    v.scores = *std::move(scores);
    v.types = *std::move(types);
    v.bos_id = *bos;
    v.eos_id = *eos;
    v.unk_id = *unk;
    auto tok = SpmTokenizer::Create(std::move(v));
    if (!tok.ok()) return tok.status();
    return finish(*std::move(tok));
  }
  if (*model == "gpt2") {
    Gpt2Tokenizer::Vocab v;
    auto merges = gguf.GetStringArray(kMergesKey);
    if (!merges.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer: ", merges.status().message()));
    }
    if (gguf.Find(kPreKey) != nullptr) {
      auto pre = gguf.GetString(kPreKey);
      if (!pre.ok()) return pre.status();
      const std::string_view p = *pre;
      if (p == "llama-bpe" || p == "llama3" || p == "llama-v3") {
        v.pre = Gpt2Tokenizer::PreTokenizer::kLlama3;
        v.ignore_merges = true;  // as Llama 3's tokenizer.json and llama.cpp
      } else if (p == "qwen2" || p == "deepseek-r1-qwen") {
        v.pre = Gpt2Tokenizer::PreTokenizer::kQwen2;
      } else if (p != "gpt-2" && p != "gpt2" && p != "default") {
        return absl::UnimplementedError(
            absl::StrCat(gguf.path(), ": ", kPreKey, " = \"", Sv(p),
                         "\" is not supported (gpt-2, default, llama-bpe, llama3, llama-v3, qwen2, "
                         "deepseek-r1-qwen): its pre-tokenizer would split text differently"));
      }
    }
    v.pieces = ToStrings(*tokens);
    v.merges = ToStrings(*merges);
    v.types = *std::move(types);
    v.bos_id = *bos;
    v.eos_id = *eos;
    auto tok = Gpt2Tokenizer::Create(std::move(v));
    if (!tok.ok()) return tok.status();
    return finish(*std::move(tok));
  }
  return absl::UnimplementedError(absl::StrCat(gguf.path(), ": ", kModelKey, " = \"", Sv(*model),
                                               "\" is not supported (llama, gpt2)"));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromLlama2c(const std::string& path,
                                                                int vocab_size) {
  auto file = MappedFile::Open(path);
  if (!file.ok()) return file.status();
  const uint8_t* data = (*file)->data();
  const size_t size = (*file)->size();
  size_t pos = 0;
  const auto fail = [&](absl::string_view msg) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", msg));
  };
  const auto read_i32 = [&](int32_t& v) {
    if (size - pos < 4) return false;
    std::memcpy(&v, data + pos, 4);
    pos += 4;
    return true;
  };

  int32_t max_token_length = 0;
  if (!read_i32(max_token_length)) return fail("truncated: no max_token_length header");
  if (max_token_length <= 0 || max_token_length > kMaxLlama2cTokenLength) {
    return fail(absl::StrCat("max_token_length = ", max_token_length,
                             " is not a plausible length; not a llama2.c tokenizer file?"));
  }
  SpmTokenizer::Vocab v;
  v.unk_id = 0;
  v.bos_id = 1;
  v.eos_id = 2;
  // A token needs at least 8 bytes (score, length), which bounds the count before reserving.
  if (vocab_size > 0 && static_cast<size_t>(vocab_size) > (size - pos) / 8) {
    return fail(absl::StrCat("truncated: vocab_size = ", vocab_size, " tokens cannot fit in ", size,
                             " bytes"));
  }
  if (vocab_size > 0) v.pieces.reserve(vocab_size);
  while (vocab_size > 0 ? v.pieces.size() < static_cast<size_t>(vocab_size) : pos < size) {
    const size_t id = v.pieces.size();
    float score = 0;
    int32_t len = 0;
    if (size - pos < 8) {
      return fail(absl::StrCat("truncated at token ", id, " (offset ", pos, ")"));
    }
    std::memcpy(&score, data + pos, 4);
    pos += 4;
    read_i32(len);
    if (len < 0 || len > max_token_length) {
      return fail(absl::StrCat("token ", id, " has length ", len, " (max_token_length ",
                               max_token_length, ")"));
    }
    if (size - pos < static_cast<size_t>(len)) {
      return fail(absl::StrCat("truncated in token ", id, ": length ", len, " at offset ", pos,
                               " but only ", size - pos, " bytes remain"));
    }
    const std::string_view raw(reinterpret_cast<const char*>(data + pos), len);
    pos += len;
    TokenType type = TokenType::kNormal;
    if (id == 0) {
      type = TokenType::kUnknown;
    } else if (id == 1 || id == 2) {
      type = TokenType::kControl;
    } else if (raw.size() == 6 && raw.starts_with("<0x") && raw.ends_with(">")) {
      type = TokenType::kByte;
    }
    v.pieces.push_back(type == TokenType::kNormal
                           ? absl::StrReplaceAll(Sv(raw), {{" ", "\xE2\x96\x81"}})
                           : std::string(raw));
    v.scores.push_back(score);
    v.types.push_back(type);
  }
  if (pos != size) {
    return fail(absl::StrCat(size - pos, " bytes left after ", v.pieces.size(),
                             " tokens: vocab_size does not match the file"));
  }
  if (v.pieces.size() < 3) {
    return fail(absl::StrCat("only ", v.pieces.size(), " tokens; need <unk>, BOS and EOS"));
  }
  auto tok = SpmTokenizer::Create(std::move(v));
  if (!tok.ok()) return tok.status();
  return std::unique_ptr<Tokenizer>(*std::move(tok));
}

}  // namespace kvlens
