#include "engine/tokenizer/tokenizer_json.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/gpt2_tokenizer.h"
#include "engine/tokenizer/spm_tokenizer.h"
#include "nlohmann/json.hpp"

namespace kvlens {
namespace {

using nlohmann::json;

// True when `node` (a pre_tokenizer or decoder, possibly a Sequence) contains `type`.
// The first node of `type` in node or its Sequence lists, or null.
const json* Find(const json& node, const std::string& type) {
  if (!node.is_object()) return nullptr;
  if (node.contains("type") && node["type"].is_string() && node["type"] == type) return &node;
  for (const char* list : {"pretokenizers", "decoders", "normalizers"}) {
    if (node.contains(list) && node[list].is_array()) {
      for (const json& n : node[list]) {
        if (const json* found = Find(n, type)) return found;
      }
    }
  }
  return nullptr;
}

bool Contains(const json& node, const std::string& type) { return Find(node, type) != nullptr; }

// Whether a Metaspace pre-tokenizer prepends ▁ to the text: prepend_scheme "always" or
// "first" (the text is one piece here), not "never"; older files say add_prefix_space.
// Hugging Face's default is to prepend.
bool MetaspacePrepends(const json& metaspace) {
  if (metaspace.contains("prepend_scheme") && metaspace["prepend_scheme"].is_string()) {
    return metaspace["prepend_scheme"] != "never";
  }
  if (metaspace.contains("add_prefix_space") && metaspace["add_prefix_space"].is_boolean()) {
    return metaspace["add_prefix_space"].get<bool>();
  }
  return true;
}

// The Split regexes of byte-level tokenizers whose pre-tokenizers kvlens implements
// (Gpt2Tokenizer::PreTokenizer), as their tokenizer.json files spell them.
constexpr char kLlama3Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr char kQwen2Regex[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromJson(const std::string& path) {
  auto bad = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", what));
  };
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("tokenizer not found: ", path));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    return bad(absl::StrCat("invalid JSON: ", e.what()));
  }
  if (!j.contains("model") || !j["model"].is_object()) return bad("missing model");
  const json& m = j["model"];
  if (m.contains("type") && !m["type"].is_string()) return bad("model.type is not a string");
  if (m.value("type", "BPE") != "BPE") {
    return absl::UnimplementedError(
        absl::StrCat(path, ": model.type \"", m.value("type", ""), "\" is not supported (BPE)"));
  }
  if (!m.contains("vocab") || !m["vocab"].is_object()) return bad("missing model.vocab");
  const json no_added = json::array();
  const json& added =
      j.contains("added_tokens") && j["added_tokens"].is_array() ? j["added_tokens"] : no_added;

  // id → piece, from the vocabulary and the added tokens. Ids are dense (checked below), so
  // none can reach the number of entries that name one; this bounds the tables up front.
  std::vector<std::string> pieces;
  std::vector<TokenType> types;
  const int64_t id_limit = static_cast<int64_t>(m["vocab"].size() + added.size());
  auto put = [&](const std::string& piece, int64_t id, TokenType type) -> absl::Status {
    if (id < 0 || id >= id_limit) {
      return bad(absl::StrCat("token id ", id, " of \"", piece, "\" is outside [0, ", id_limit,
                              "), the number of tokens listed"));
    }
    if (static_cast<size_t>(id) >= pieces.size()) {
      pieces.resize(id + 1);
      types.resize(id + 1, TokenType::kUnused);
    }
    pieces[id] = piece;
    types[id] = type;
    return absl::OkStatus();
  };
  const bool byte_level = Contains(j.value("pre_tokenizer", json()), "ByteLevel") ||
                          Contains(j.value("decoder", json()), "ByteLevel");
  for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
    if (!it.value().is_number_integer())
      return bad(absl::StrCat("model.vocab[\"", it.key(), "\"] is not an id"));
    TokenType type = TokenType::kNormal;
    const std::string& p = it.key();
    if (!byte_level && p.size() == 6 && p.rfind("<0x", 0) == 0 && p.back() == '>')
      type = TokenType::kByte;
    const int64_t id = it.value().get<int64_t>();
    if (id >= 0 && id < static_cast<int64_t>(types.size()) && types[id] != TokenType::kUnused) {
      return bad(absl::StrCat("model.vocab[\"", pieces[id], "\"] and model.vocab[\"", p,
                              "\"] both have id ", id));
    }
    if (auto s = put(p, id, type); !s.ok()) return s;
  }
  int32_t bos = -1, eos = -1, unk = -1;
  for (size_t i = 0; i < added.size(); ++i) {
    const json& t = added[i];
    if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() ||
        !t.contains("content") || !t["content"].is_string() ||
        (t.contains("special") && !t["special"].is_boolean())) {
      return bad(absl::StrCat("added_tokens[", i,
                              "] needs an integer id, a string content and a bool special"));
    }
    const std::string content = t["content"].get<std::string>();
    const bool special = t.value("special", false);
    const int64_t id = t["id"].get<int64_t>();
    if (auto s = put(content, id, special ? TokenType::kControl : TokenType::kUserDefined); !s.ok())
      return s;
    if (content == "<|endoftext|>") bos = eos = static_cast<int32_t>(id);
    if (content == "<s>" || content == "<|begin_of_text|>" || content == "<bos>") {
      bos = static_cast<int32_t>(id);
    }
    if (content == "</s>" || content == "<|end_of_text|>" || content == "<eos>") {
      eos = static_cast<int32_t>(id);
    }
    if (content == "<unk>") unk = static_cast<int32_t>(id);
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (types[i] == TokenType::kUnused && pieces[i].empty())
      return bad(absl::StrCat("token id ", i, " has no piece"));
  }

  // Merges as "left right" (one space) or ["left", "right"]. As in Hugging Face's BPE, both
  // sides and what they make must be in model.vocab: anything else is a corrupt file.
  std::vector<std::string> merges;
  if (m.contains("merges") && m["merges"].is_array()) {
    for (const json& mg : m["merges"]) {
      const std::string where = absl::StrCat("model.merges[", merges.size(), "]");
      std::string left, right;
      if (mg.is_string()) {
        const std::string text = mg.get<std::string>();
        const size_t sp = text.find(' ');
        if (sp == std::string::npos || text.find(' ', sp + 1) != std::string::npos) {
          return bad(absl::StrCat(where, " \"", text, "\" is not \"left right\""));
        }
        left = text.substr(0, sp);
        right = text.substr(sp + 1);
      } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
        left = mg[0].get<std::string>();
        right = mg[1].get<std::string>();
      } else {
        return bad(absl::StrCat(where, " is malformed"));
      }
      for (const std::string& piece : {left, right, left + right}) {
        if (!m["vocab"].contains(piece)) {
          return bad(absl::StrCat(where, " (\"", left, "\", \"", right, "\"): \"", piece,
                                  "\" is not in model.vocab"));
        }
      }
      merges.push_back(left + " " + right);
    }
  }

  if (byte_level) {
    Gpt2Tokenizer::Vocab v;
    // GPT-2's regex is ByteLevel's own; a Split before it brings another (Llama 3, Qwen2).
    const json pre_tokenizer = j.value("pre_tokenizer", json());  // Find points into it
    if (const json* split = Find(pre_tokenizer, "Split")) {
      const json pattern = split->value("pattern", json());
      const std::string regex =
          pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()
              ? pattern["Regex"].get<std::string>()
              : std::string();
      if (regex == kLlama3Regex) {
        v.pre = Gpt2Tokenizer::PreTokenizer::kLlama3;
      } else if (regex == kQwen2Regex) {
        v.pre = Gpt2Tokenizer::PreTokenizer::kQwen2;
      } else {
        return absl::UnimplementedError(absl::StrCat(
            path, ": pre_tokenizer Split pattern ", pattern.dump(),
            " is not supported (GPT-2's ByteLevel regex, Llama 3's or Qwen2's Split regex)"));
      }
    }
    if (m.contains("ignore_merges")) {
      if (!m["ignore_merges"].is_boolean()) return bad("model.ignore_merges is not a bool");
      v.ignore_merges = m["ignore_merges"].get<bool>();
    }
    v.pieces = std::move(pieces);
    v.types = std::move(types);
    v.merges = std::move(merges);
    v.bos_id = bos;
    v.eos_id = eos;
    auto t = Gpt2Tokenizer::Create(std::move(v));
    if (!t.ok()) return t.status();
    return std::unique_ptr<Tokenizer>(*std::move(t));
  }
  // sentencepiece-style: a merge's rank becomes the score of the piece it makes, so the
  // highest-scoring merge first is exactly BPE's merge order.
  SpmTokenizer::Vocab v;
  v.scores.assign(pieces.size(), 0.0f);
  absl::flat_hash_map<std::string, int32_t> id_of;
  for (size_t i = 0; i < pieces.size(); ++i) id_of.emplace(pieces[i], static_cast<int32_t>(i));
  for (size_t r = 0; r < merges.size(); ++r) {
    const size_t sp = merges[r].find(' ');
    if (sp == std::string::npos) return bad(absl::StrCat("model.merges[", r, "] has no space"));
    auto it = id_of.find(merges[r].substr(0, sp) + merges[r].substr(sp + 1));
    if (it != id_of.end()) v.scores[it->second] = -static_cast<float>(r) - 1.0f;
  }
  if (m.contains("unk_token") && m["unk_token"].is_string()) {
    auto it = id_of.find(m["unk_token"].get<std::string>());
    if (it != id_of.end()) unk = it->second;
  }
  v.pieces = std::move(pieces);
  v.types = std::move(types);
  v.bos_id = bos;
  v.eos_id = eos;
  v.unk_id = unk;
  const json pre_tokenizer = j.value("pre_tokenizer", json());  // Find points into it
  const json* metaspace = Find(pre_tokenizer, "Metaspace");
  v.add_space_prefix = Contains(j.value("normalizer", json()), "Prepend") ||
                       (metaspace != nullptr && MetaspacePrepends(*metaspace));
  auto t = SpmTokenizer::Create(std::move(v));
  if (!t.ok()) return t.status();
  return std::unique_ptr<Tokenizer>(*std::move(t));
}

}  // namespace kvlens
