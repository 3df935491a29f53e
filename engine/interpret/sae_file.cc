#include "engine/interpret/sae_file.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/model/npz.h"
#include "engine/model/safetensors.h"
#include "kernels/weight.h"
#include "nlohmann/json.hpp"

namespace kvlens::interpret {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

absl::Status Bad(const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", what));
}

// [rows, cols] row-major → [cols, rows].
std::vector<float> Transposed(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
  return t;
}

std::string ShapeText(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
  return out + "]";
}

// A safetensors tensor of exactly `shape`, widened to f32.
absl::StatusOr<std::vector<float>> ReadTensor(const SafetensorsFile& f, const std::string& name,
                                              const std::vector<int64_t>& shape) {
  const SafetensorsTensor* t = f.Find(name);
  if (t == nullptr) return Bad(f.path(), "tensor " + name + " is missing");
  if (t->shape != shape) {
    return Bad(f.path(), absl::StrCat("tensor ", name, ": expected shape ", ShapeText(shape),
                                      ", got ", ShapeText(t->shape)));
  }
  auto view = SafetensorsWeightView(*t);
  if (!view.ok()) return view.status();
  std::vector<float> out(static_cast<size_t>(view->rows * view->cols));
  for (int64_t r = 0; r < view->rows; ++r) {
    kernels::DequantizeRow(*view, r, out.data() + r * view->cols);
  }
  return out;
}

absl::StatusOr<std::vector<float>> ReadArray(const NpzFile& f, const std::string& name,
                                             const std::vector<int64_t>& shape) {
  const NpzArray* a = f.Find(name);
  if (a == nullptr) return Bad(f.path(), "array " + name + " is missing");
  if (a->shape != shape) {
    return Bad(f.path(), absl::StrCat("array ", name, ": expected shape ", ShapeText(shape),
                                      ", got ", ShapeText(a->shape)));
  }
  return NpzFloats(*a);
}

// The four (five) tensors through `read`, into `sae` (d_in, d_sae, architecture set).
template <typename Read>
absl::Status FillWeights(Sae& sae, Read read) {
  const int64_t din = sae.d_in, ds = sae.d_sae;
  auto w_enc = read("W_enc", std::vector<int64_t>{din, ds});
  if (!w_enc.ok()) return w_enc.status();
  auto w_dec = read("W_dec", std::vector<int64_t>{ds, din});
  if (!w_dec.ok()) return w_dec.status();
  auto b_enc = read("b_enc", std::vector<int64_t>{ds});
  if (!b_enc.ok()) return b_enc.status();
  auto b_dec = read("b_dec", std::vector<int64_t>{din});
  if (!b_dec.ok()) return b_dec.status();
  if (sae.architecture == SaeArchitecture::kJumpRelu) {
    auto threshold = read("threshold", std::vector<int64_t>{ds});
    if (!threshold.ok()) return threshold.status();
    sae.threshold = *std::move(threshold);
  }
  sae.enc = Transposed(*w_enc, din, ds);
  sae.dec = Transposed(*w_dec, ds, din);
  sae.b_enc = *std::move(b_enc);
  sae.b_dec = *std::move(b_dec);
  return absl::OkStatus();
}

absl::Status ReadSaeLens(const fs::path& dir, Sae& sae, bool hook_given) {
  const std::string cfg_path = (dir / "cfg.json").string();
  std::ifstream in(cfg_path);
  if (!in) return absl::NotFoundError(absl::StrCat(cfg_path, " is missing (a SAELens directory)"));
  json cfg;
  try {
    cfg = json::parse(in);
  } catch (const json::exception& e) {
    return Bad(cfg_path, absl::StrCat("invalid JSON: ", e.what()));
  }
  if (!cfg.is_object()) return Bad(cfg_path, "not a JSON object");
  auto integer = [&](const char* key, int& out) -> absl::Status {
    if (!cfg.contains(key) || !cfg[key].is_number_integer() || cfg[key].get<int64_t>() < 1 ||
        cfg[key].get<int64_t>() > (int64_t{1} << 24)) {
      return Bad(cfg_path, absl::StrCat(key, " must be a positive integer"));
    }
    out = cfg[key].get<int>();
    return absl::OkStatus();
  };
  if (absl::Status s = integer("d_in", sae.d_in); !s.ok()) return s;
  if (absl::Status s = integer("d_sae", sae.d_sae); !s.ok()) return s;
  // architecture (SAELens ≥ 3), else the activation function of older configs.
  std::string arch;
  if (cfg.contains("architecture") && cfg["architecture"].is_string()) {
    arch = cfg["architecture"].get<std::string>();
  } else if (cfg.contains("activation_fn_str") && cfg["activation_fn_str"].is_string()) {
    arch = cfg["activation_fn_str"].get<std::string>() == "topk" ? "topk" : "standard";
  } else {
    arch = "standard";
  }
  if (arch == "standard") {
    sae.architecture = SaeArchitecture::kStandard;
  } else if (arch == "jumprelu") {
    sae.architecture = SaeArchitecture::kJumpRelu;
  } else if (arch == "topk") {
    sae.architecture = SaeArchitecture::kTopK;
    const json* k = nullptr;
    if (cfg.contains("k")) k = &cfg["k"];
    if (cfg.contains("activation_fn_kwargs") && cfg["activation_fn_kwargs"].is_object() &&
        cfg["activation_fn_kwargs"].contains("k")) {
      k = &cfg["activation_fn_kwargs"]["k"];
    }
    if (k == nullptr || !k->is_number_integer() || k->get<int64_t>() < 1 ||
        k->get<int64_t>() > sae.d_sae) {
      return Bad(
          cfg_path,
          absl::StrCat("a topk SAE needs activation_fn_kwargs.k in [1, d_sae = ", sae.d_sae, "]"));
    }
    sae.k = k->get<int>();
  } else {
    return Bad(cfg_path,
               "architecture \"" + arch + "\" is not one kvlens runs (standard, jumprelu, topk)");
  }
  if (cfg.contains("normalize_activations") && cfg["normalize_activations"].is_string() &&
      cfg["normalize_activations"].get<std::string>() != "none") {
    return Bad(cfg_path, "normalize_activations \"" +
                             cfg["normalize_activations"].get<std::string>() +
                             "\" is not supported (only \"none\": its scale is not in the file)");
  }
  if (cfg.contains("hook_head_index") && !cfg["hook_head_index"].is_null()) {
    return Bad(cfg_path, "hook_head_index is set: SAEs of one head's output are not supported");
  }
  if (cfg.contains("finetuning_scaling_factor") && cfg["finetuning_scaling_factor"].is_boolean() &&
      cfg["finetuning_scaling_factor"].get<bool>()) {
    return Bad(cfg_path, "finetuning_scaling_factor is true: its scaling is not supported");
  }
  // SAELens's default: the input is centred by b_dec.
  sae.apply_b_dec_to_input = !cfg.contains("apply_b_dec_to_input") ||
                             !cfg["apply_b_dec_to_input"].is_boolean() ||
                             cfg["apply_b_dec_to_input"].get<bool>();
  if (!hook_given) {
    const json* hook = nullptr;
    if (cfg.contains("hook_name") && cfg["hook_name"].is_string()) hook = &cfg["hook_name"];
    if (cfg.contains("metadata") && cfg["metadata"].is_object() &&
        cfg["metadata"].contains("hook_name") && cfg["metadata"]["hook_name"].is_string()) {
      hook = &cfg["metadata"]["hook_name"];
    }
    if (hook == nullptr) {
      return Bad(cfg_path, "hook_name is missing: give the hook as PATH@blocks.L.hook_…");
    }
    sae.hook_name = hook->get<std::string>();
  }
  auto file = SafetensorsFile::Open((dir / "sae_weights.safetensors").string());
  if (!file.ok()) return file.status();
  return FillWeights(sae, [&](const std::string& name, const std::vector<int64_t>& shape) {
    return ReadTensor(**file, name, shape);
  });
}

absl::Status ReadGemmaScope(const std::string& path, Sae& sae) {
  auto file = NpzFile::Open(path);
  if (!file.ok()) return file.status();
  const NpzArray* w_enc = (*file)->Find("W_enc");
  if (w_enc == nullptr) return Bad(path, "array W_enc is missing");
  if (w_enc->shape.size() != 2 || w_enc->shape[0] < 1 || w_enc->shape[1] < 1) {
    return Bad(path, "array W_enc: expected [d_in, d_sae], got " + ShapeText(w_enc->shape));
  }
  sae.d_in = static_cast<int>(w_enc->shape[0]);
  sae.d_sae = static_cast<int>(w_enc->shape[1]);
  sae.architecture = SaeArchitecture::kJumpRelu;
  sae.apply_b_dec_to_input = false;
  return FillWeights(sae, [&](const std::string& name, const std::vector<int64_t>& shape) {
    return ReadArray(**file, name, shape);
  });
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Sae>> LoadSae(const std::string& spec) {
  auto sae = std::make_shared<Sae>();
  std::string path = spec;
  if (const size_t eq = path.find('='); eq != std::string::npos) {
    sae->name = path.substr(0, eq);
    path = path.substr(eq + 1);
    if (sae->name.empty()) return absl::InvalidArgumentError("--sae " + spec + ": empty NAME=");
  }
  bool hook_given = false;
  if (const size_t at = path.rfind('@'); at != std::string::npos) {
    sae->hook_name = path.substr(at + 1);
    path = path.substr(0, at);
    hook_given = true;
  }
  if (path.empty()) return absl::InvalidArgumentError("--sae " + spec + ": no path");
  sae->path = path;
  std::error_code ec;
  if (!fs::exists(path, ec))
    return absl::NotFoundError(absl::StrCat("SAE ", path, " does not exist"));
  if (fs::is_directory(path, ec)) {
    if (absl::Status s = ReadSaeLens(path, *sae, hook_given); !s.ok()) return s;
  } else if (absl::EndsWith(path, ".npz")) {
    if (!hook_given) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": a Gemma Scope .npz names no hook: give it as ", path,
                       "@blocks.L.hook_resid_post (or the hook it was trained on)"));
    }
    if (absl::Status s = ReadGemmaScope(path, *sae); !s.ok()) return s;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("SAE ", path,
                     " is neither a SAELens directory (cfg.json + sae_weights.safetensors) nor "
                     "a Gemma Scope .npz"));
  }
  if (absl::Status s = ParseSaeHook(sae->hook_name, &sae->hook, &sae->layer); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  if (sae->name.empty()) sae->name = sae->hook_name;
  return std::shared_ptr<const Sae>(std::move(sae));
}

}  // namespace kvlens::interpret
