// The Python client (clients/python/kvlens) against a live server: every method it has for
// a conversation (chat=...) gives what the same conversation written out by hand as text
// gives, and what the C++ stubs read from the same server (token ids, an attention row, the
// generated tokens, steered too; a prompt's scores). Runs Debian's /usr/bin/python3 with
// PYTHONPATH=clients/python.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/interpret/sae_file.h"
#include "nlohmann/json.hpp"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/interpret_test_util.h"
#include "tests/server/python_script.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

constexpr char kChatText[] =
    "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nOnce upon a "
    "time<|im_end|>\n<|im_start|>assistant\n";

constexpr char kScript[] = R"(
import json, sys
import numpy as np
from kvlens import Client, get_act_name
c = Client(sys.argv[1])
conv = [{"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Once upon a time"}]
text = ("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nOnce upon a time"
        "<|im_end|>\n<|im_start|>assistant\n")
out = {"tok_chat": c.tokenize(chat=conv), "tok_text": c.tokenize(text)}
m = c.attention_maps(chat=conv, layers=[1], heads=[0, 2])
last = len(m.tokens) - 1
out["maps_tokens"] = m.tokens
out["maps_shape"] = list(m.probs.shape)
out["maps_row"] = m.probs[0, 1, last, :].tolist()
me = c.attention_maps(chat=conv, layers=[-1], heads=[-1, 0])  # from the end, resolved
out["maps_end"] = [me.layers, me.heads, list(me.probs.shape)]
out["objective_chat"] = c.gradient_probe(chat=conv, targets=[(last, 5)]).objective
out["objective_text"] = c.gradient_probe(text=text, targets=[(last, 5)]).objective
# Layers and heads counted from the end, as the request's: the last layer's last query head
# and (grad.k, grad.rot_k) its KV head; grad.embeddings, per neither, read without them.
gp = c.gradient_probe(chat=conv, targets=[(last, 5)], want=("q", "k", "rot_k", "embeddings"),
                      layers=[-1], heads=[-1], fp64=True)
out["gp_keys"] = sorted(f"{n}:{l}:{h}" for n, d in gp.tensors.items() for l, h in d)
out["gp_same"] = [bool((gp.get("grad.q", -1, -1) == gp.tensors["grad.q"][k]).all())
                  for k in gp.tensors["grad.q"]] + [
                 bool((gp.get(n, -1, -1) == gp.tensors[n][k]).all())
                 for n in ("grad.k", "grad.rot_k") for k in gp.tensors[n]] + [
                 gp.get("grad.embeddings").shape == gp.tensors["grad.embeddings"][(-1, -1)].shape]
# TransformerLens's gradient cache beside run_with_cache: the same keys and shapes, so that
# activation x gradient is elementwise (neuron attribution at mlp_post)
gh = c.gradient_probe(chat=conv, targets=[(last, 5)], hooks=("mlp_post", "blocks.0.attn.hook_z"),
                      layers=[-1], fp64=True, verify=2)
ac = c.run_with_cache(chat=conv, hooks=("mlp_post", "blocks.0.attn.hook_z"), layers=[-1], fp64=True)
out["grad_cache"] = [sorted(gh.grad_cache.keys()), sorted(ac.keys()),
                     list(gh.grad_cache["mlp_post", -1].shape), list(ac["mlp_post", -1].shape),
                     list(gh.grad_cache["z", 0].shape), list(ac["z", 0].shape), gp.grad_cache is None]
# verify with hooks: a report per tensor kind and per hook (0 samples where no edit moves one)
out["gh_verify"] = [[name, t["samples"], t["max_rel_err"] <= 1e-4]
                    for name, t in gh.verify["tensors"].items()]
# k before RoPE and after it: a rotation apart, so each key's gradient keeps its length
pre_k, rot_k = gp.get("grad.k", -1, -1), gp.get("grad.rot_k", -1, -1)
out["gp_rotation"] = [bool(np.allclose(np.linalg.norm(pre_k, axis=-1),
                                       np.linalg.norm(rot_k, axis=-1), rtol=1e-12, atol=1e-300)),
                      float(np.abs(pre_k - rot_k).max() / np.abs(rot_k).max())]
out["lens_chat"] = [r.top[0].token for r in c.logit_lens(chat=conv).rows]
out["lens_text"] = [r.top[0].token for r in c.logit_lens(text=text).rows]
out["ablation_change"] = c.intervene(chat=conv, ablations=[(0, 0)],
                                     targets=[(last, 5)]).max_abs_logit_change
# A neuron ablated at position 4 leaves the rows before it alone (causal) and moves the last;
# mean-ablated at every position, it moves the logits too.
ne = c.intervene(chat=conv, neuron_ablations=[(0, 3, 4)], targets=[(3, 5), (last, 5)], fp64=True)
out["neuron_ablation"] = [ne.effects[0].edited_logprob == ne.effects[0].clean_logprob,
                          ne.effects[1].edited_logprob != ne.effects[1].clean_logprob,
                          c.intervene(chat=conv, neuron_ablations=[(-1, 3)], mean=True,
                                      targets=[(last, 5)]).max_abs_logit_change > 0]
# Patching sweeps: the last layer's resid_post at the objective's position is the source's
# final stream there, so that cell recovers the source's score exactly, and the rest none.
a, b = [1, 403, 407, 261, 378, 11], [1, 403, 407, 300, 378, 11]
sw = c.patch_sweep(tokens=a, patch_source=b, hook="resid_post", layers=[-1],
                   logit_diff=(-1, 42, 300), fp64=True)
zs = c.patch_sweep(tokens=a, patch_source=b, hook="z", layers=[0, 1], positions=(2, 5),
                   targets=[(5, 7)])
ps = c.patch_sweep(tokens=a, patch_source=b, hook="pattern", layers=[1], positions=(4, 6),
                   targets=[(5, 7)])
vs = c.patch_sweep(tokens=a, patch_source=b, hook="v", layers=[0], positions=(2, 4),
                   targets=[(5, 7)])
# every position of a layer's resid_pre from the source is the source's run: all recovered
alls = c.patch_sweep(tokens=a, patch_source=b, layers=[0, -1], logit_diff=(-1, 42, 300),
                     fp64=True, all_positions=True)
allz = c.patch_sweep(tokens=a, patch_source=b, hook="z", layers=[1], positions=(2, 5),
                     targets=[(5, 7)], all_positions=True)
# attribution patching: past the scored position no gradient flows, so those cells are clean
atp = c.patch_sweep(tokens=a, patch_source=b, hook="v", layers=[0], logit_diff=(3, 42, 300),
                    fp64=True, attribution=True)
# the QK fix on the last layer's queries: a query's pattern reaches only its own row's
# logits, so the cells before the scored row stay clean; the scored row's differ from AtP's
qk = [c.patch_sweep(tokens=a, patch_source=b, hook="q", layers=[-1], logit_diff=(-1, 42, 300),
                    fp64=True, attribution=True, qk_fix=fix) for fix in (False, True)]
out["qk_fix"] = [bool((qk[1].metric[0, :, :-1] == qk[1].clean).all()),
                 bool((qk[1].metric[0, :, -1] != qk[0].metric[0, :, -1]).all()),
                 list(qk[1].metric.shape)]
# a second pair with its own logit difference: the means recover the same way, all at the
# last position (each pair's patched run there is its source's)
pairs = c.patch_sweep(tokens=a, patch_source=b, hook="resid_post", layers=[-1],
                      logit_diff=(-1, 42, 300), fp64=True, per_pair=True,
                      more_pairs=[dict(tokens=a, patch_source=b, logit_diff=(-1, 7, 300))])
try:
    sw.pair_recovered()
    no_pairs = "answered"
except ValueError as e:
    no_pairs = str(e)
out["pairs"] = [(np.round(pairs.recovered(), 12) + 0.0).tolist(), pairs.num_pairs, sw.num_pairs,
                (np.round(pairs.pair_recovered(), 12) + 0.0).tolist(),
                bool(np.allclose(pairs.pair_metric.mean(axis=0), pairs.metric)),
                bool(np.isclose(pairs.pair_clean.mean(), pairs.clean)), no_pairs]
out["sweep"] = [(sw.recovered() + 0.0).tolist(),  # (+ 0.0: no -0.0)
                list(sw.metric.shape), list(zs.metric.shape) + list(ps.metric.shape),
                zs.layers, list(zs.positions), list(vs.metric.shape),
                alls.recovered().tolist(), list(allz.metric.shape),
                list(atp.metric.shape), bool((atp.metric[:, :, 4:] == atp.clean).all()),
                bool((atp.metric[:, :, :4] != atp.clean).any())]
other = c.intervene(text=text, head_patches=[(0, 1, -1, 0)], patch_source="Lily",
                    targets=[(0, 5)])
out["head_patch_change"] = [
    c.intervene(text=text, head_patches=[(-1, -1, -1, -1), (0, 1, 2, 2), (1, -1, 2, 2, "k"),
                                         (0, 0, 1, 1, "v"), (-1, 2, -1, -1, "q")],
                patches=[(0, 3, 3, "attn_out"), (-1, -1, -1, "resid_post"), (1, 2, 2)],
                patch_source=text).max_abs_logit_change,
    other.max_abs_logit_change, other.effects[0].clean_logprob == other.effects[0].edited_logprob]
out["generated"] = c.generate(chat=conv, max_new_tokens=4)[0]
# attention rows: [layers, heads, keys] per token, as asked (all of them for [])
_, _, picked = c.generate(chat=conv, max_new_tokens=2, attention_layers=[-1, 0],
                          attention_heads=[1])
_, _, every = c.generate(chat=conv, max_new_tokens=2, attention_layers=[], attention_heads=[])
out["rows"] = [[list(r.shape) for r in picked], [list(r.shape) for r in every],
               bool(np.allclose(picked[1].sum(-1), 1.0)),
               bool(np.array_equal(picked[1][1, 0], every[1][0, 1]))]
out["steered"] = c.generate(chat=conv, max_new_tokens=4, steering=[
    {"hook": "blocks.0.hook_resid_mid", "vector": [0.25 * (i % 7) - 0.75 for i in range(256)],
     "coefficient": 3},
    {"sae": "enc", "feature": 2, "coefficient": -20, "start_position": 5}])[0]
out["sampled"] = c.generate(chat=conv, max_new_tokens=6, sampling={
    "temperature": 0.9, "top_p": 0.95, "seed": 7, "logit_bias": {5: 2.5}}, stop=["zz"],
    min_new_tokens=2)[0]
gs = c.generate_scored(chat=conv, max_new_tokens=4, top=2,
                      sampling={"temperature": 0.9, "seed": 3})
out["gs_tokens"], out["gs_text"], out["gs_finish"] = gs.tokens, gs.text, gs.finish_reason
out["gs_logprobs"], out["gs_total"] = gs.logprobs.tolist(), gs.total()
out["gs_top"] = [[t for t, _ in row] for row in gs.top]
sc = c.score(chat=conv, top=2)
out["score_tokens"], out["score_top"] = sc.tokens, [[t for t, _ in row] for row in sc.top]
out["score_logprobs"] = [None] + sc.logprobs[1:].tolist()
out["score_total"] = sc.total()
cache = c.run_with_cache(chat=conv, hooks=("z", "pattern", "ln_final"), layers=[1], fp64=True)
out["cache_keys"] = sorted(cache)
out["cache_z_shape"] = list(cache["z.1"].shape)
out["cache_z_row"] = cache["z.1"][last, 2].tolist()
out["cache_pattern_shape"] = list(cache["pattern.1"].shape)
out["cache_pattern_row"] = cache["pattern.1"][2, last].tolist()  # head 2, the last query
out["cache_tuple_same"] = bool((cache["pattern", 1] == cache["pattern.1"]).all())
end = c.run_with_cache(chat=conv, hooks=("resid_post",), layers=[-1])  # the last layer
full = c.run_with_cache(chat=conv, hooks=("blocks.1.attn.hook_pattern", "ln_final.hook_normalized",
                                          "ln_final.hook_scale", "resid_post"),
                        layers=[-1], fp64=True)  # TransformerLens's full names at their layers
stream = full["resid_post", -1]  # what the final norm reads
if c.model_info().architecture == "gpt2":
    stream = stream - stream.mean(-1, keepdims=True)
out["cache_full"] = [sorted(full),
                     bool((full["blocks.1.attn.hook_pattern"] == cache["pattern.1"]).all()),
                     float(np.abs(full["ln_final.hook_normalized"] * full["ln_final.hook_scale"]
                                  - stream).max() / np.abs(stream).max()),
                     "blocks.1.attn.hook_pattern" in full, "blocks.2.attn.hook_pattern" in full]
names = c.hook_names()  # TransformerLens's model.hook_dict order; no rot_q on GPT-2
out["hook_names"] = [len(names), names[0], names[-1], sum("rot_" in n for n in names)]
maps = c.run_with_cache(chat=conv, names_filter=lambda n: n.endswith(".hook_pattern"), fp64=True)
out["filtered"] = [sorted(maps), bool((maps["pattern", 1] == cache["pattern.1"]).all())]
out["filtered_one"] = sorted(c.run_with_cache(chat=conv, names_filter="blocks.0.hook_mlp_out"))
# TransformerLens's stacks, from separately read hooks: the parts add up to the stream,
# and through the frozen final norm to its normalized input.
whole = c.run_with_cache(chat=conv, hooks=("embed", "resid_pre", "resid_post", "attn_out",
                                           "mlp_out", "result", "ln_final_scale",
                                           "ln_final_normalized", "ln1_scale", "ln1_normalized"),
                         fp64=True)
acc, acc_labels = whole.accumulated_resid(return_labels=True)
dec, dec_labels = whole.decompose_resid(return_labels=True)
heads, head_labels = whole.stack_head_results(layer=1, return_labels=True)
final = whole["resid_post", -1]
rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
out["stacks"] = {
    "acc_labels": acc_labels, "dec_labels": dec_labels, "head_labels": head_labels[:2],
    "acc_last": rel(acc[-1], final), "dec_sum": rel(dec.sum(0), final),
    "ln_final": rel(whole.apply_ln_to_stack(dec).sum(0), whole["ln_final_normalized"]),
    "ln1": rel(whole.accumulated_resid(layer=1, apply_ln=True)[1], whole["ln1_normalized", 1]),
    "heads": rel(heads.sum(0), whole["attn_out", 0]), "heads_shape": list(heads.shape)}
# TransformerLens's cache keys through its aliases (utils.get_act_name).
out["aliases"] = [bool((whole["scale", -1, "ln1"] == whole["ln1_scale", 1]).all()),
                  bool((cache["attn", 1] == cache["pattern.1"]).all()),
                  get_act_name("normalized", None, "ln_final"), get_act_name("pre_linear", 0),
                  bool((cache.get("blocks.1.attn.hook_pattern") == cache["pattern.1"]).all()),
                  cache.get(("z", 9), "absent")]
try:
    c.run_with_cache(chat=conv, names_filter=lambda n: False)
    out["filter_none"] = ""
except ValueError as e:
    out["filter_none"] = str(e)
out["cache_end"] = [sorted(end), bool((end["resid_post", -1] == end[sorted(end)[0]]).all())]
d = c.logit_attribution(chat=conv, token=5, heads=True)
out["dla_logit"], out["dla_total"], out["dla_heads"] = d.logit, d.total, len(d.heads)
out["saes"] = [s.name for s in c.list_saes()]
sf = c.sae_features(chat=conv, sae="enc", top_k=3, feature_ids=[1])
out["sae_l0"] = [r.l0 for r in sf.rows]
out["sae_top"] = [[f.index for f in r.top] for r in sf.rows]
out["sae_f1"] = [r.features[0] for r in sf.rows]
out["single"] = c.to_single_token("Lily")
ids = c.to_tokens("Once upon a time", prepend_bos=False)
out["tl_tokens"] = [ids, c.to_tokens("Once upon a time"), c.to_string(ids),
                    c.to_str_tokens("Once upon a time", prepend_bos=False), c.to_str_tokens(ids)]
try:
    c.to_single_token("once upon")
    out["not_single"] = ""
except ValueError as e:
    out["not_single"] = str(e)
print(json.dumps(out))
)";

TEST(PythonClient, ChatInputsEqualTheWrittenOutTextAndTheCppStubs) {
  KVLENS_REQUIRE_FILE(TestData("stories260K/stories260K.gguf"));  // its tokenizer
  ASSERT_TRUE(OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  const std::string path = MakeChatMlModel();
  ASSERT_FALSE(path.empty()) << "tests/oracle/make_quantized_gguf.py failed";
  // An SAE on the model's residual stream (256 wide), for sae_features.
  const std::string sae_path = ::testing::TempDir() + "kvlens_python_client_sae.npz";
  ASSERT_TRUE(MakeSae(sae_path, "--format npz --d-in 256 --d-sae 32"));
  server::InterpretOptions interpret;
  auto sae = interpret::LoadSae("enc=" + sae_path + "@blocks.1.hook_resid_post");
  std::remove(sae_path.c_str());
  ASSERT_TRUE(sae.ok()) << sae.status();
  interpret.saes.push_back(*sae);
  TestServer server(path, TestServer::DefaultOptions(), 1, interpret);
  std::remove(path.c_str());
  ASSERT_TRUE(server.ok()) << server.error();

  nlohmann::json out;
  ASSERT_TRUE(RunScript("kvlens_python_client_test.py", kScript, server.address(), &out));

  // to_single_token(): the one id the C++ stub's Tokenize (no BOS) gets; more is an error.
  for (const auto& [text, key] :
       {std::pair<std::string, std::string>{"Lily", "single"}, {"once upon", "not_single"}}) {
    v1::TokenizeRequest request;
    request.set_text(text);
    request.set_add_bos(false);
    v1::TokenizeResponse response;
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(server.stub().Tokenize(&context, request, &response).ok());
    if (key == "single") {
      ASSERT_EQ(response.token_ids_size(), 1);
      EXPECT_EQ(out[key].get<int32_t>(), response.token_ids(0));
    } else {
      ASSERT_GT(response.token_ids_size(), 1);
      EXPECT_EQ(out[key].get<std::string>(),
                absl::StrCat("'once upon' is ", response.token_ids_size(), " tokens [",
                             absl::StrJoin(response.token_ids(), ", "), "], not one"));
    }
  }
  // TransformerLens's to_tokens / to_string / to_str_tokens: the model's own tokenizer.
  {
    const Tokenizer& tok = *server.model().tokenizer;
    const std::vector<int32_t> ids = tok.Encode("Once upon a time", false);
    std::vector<std::string> pieces;
    for (int32_t id : ids) pieces.push_back(tok.Decode({id}));
    const nlohmann::json& tl = out["tl_tokens"];
    EXPECT_EQ(tl[0].get<std::vector<int32_t>>(), ids);
    EXPECT_EQ(tl[1].get<std::vector<int32_t>>(), tok.Encode("Once upon a time", tok.adds_bos()));
    EXPECT_EQ(tl[2].get<std::string>(), "Once upon a time");
    EXPECT_EQ(tl[3].get<std::vector<std::string>>(), pieces);
    EXPECT_EQ(tl[4].get<std::vector<std::string>>(), pieces);
  }
  // Token ids: chat = written-out text = what the C++ stub gets for the text.
  v1::TokenizeRequest by_text;
  by_text.set_text(kChatText);
  v1::TokenizeResponse tokenized;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(server.stub().Tokenize(&context, by_text, &tokenized).ok());
  }
  const std::vector<int32_t> ids(tokenized.token_ids().begin(), tokenized.token_ids().end());
  ASSERT_GT(ids.size(), 10u);
  EXPECT_EQ(out["tok_chat"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(out["tok_text"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(out["maps_tokens"].get<std::vector<int32_t>>(), ids);

  // An attention row, decoded from the chunks by the client, equals the C++ stub's.
  const int n = static_cast<int>(ids.size());
  EXPECT_EQ(out["maps_shape"].get<std::vector<int>>(), (std::vector<int>{1, 2, n, n}));
  // Layers and heads from the end come back resolved, as the model counts them.
  const ModelConfig& config = server.model().config;
  EXPECT_EQ(out["maps_end"].dump(),
            absl::StrCat("[[", config.num_layers - 1, "],[", config.num_heads - 1, ",0],[1,2,", n,
                         ",", n, "]]"));
  v1::AttentionMapsRequest maps;
  *maps.mutable_input() = IdsInput(ids);
  maps.add_layers(1);
  maps.add_heads(2);
  const AttentionResult want = RunAttentionMaps(*InterpretStub(server), maps);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  const std::vector<double> row = out["maps_row"].get<std::vector<double>>();
  ASSERT_EQ(row.size(), static_cast<size_t>(n));
  double sum = 0;
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(row[k], want.probs[static_cast<size_t>(n - 1) * n + k]) << k;
    sum += row[k];
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);

  // The other Interpret methods and Generate: chat = text.
  EXPECT_EQ(out["objective_chat"].get<double>(), out["objective_text"].get<double>());
  EXPECT_LT(out["objective_chat"].get<double>(), 0.0);  // a log-probability
  EXPECT_EQ(out["lens_chat"], out["lens_text"]);
  EXPECT_FALSE(out["lens_chat"].empty());
  EXPECT_GT(out["ablation_change"].get<double>(), 0.0);
  EXPECT_EQ(out["neuron_ablation"].dump(), "[true,true,true]");
  // A head's output (and the stream's sites) patched from the same text changes nothing;
  // from another prompt, only rows from the patched one on (row 0's log-prob stays its clean
  // value).
  EXPECT_EQ(out["head_patch_change"][0].get<double>(), 0.0);
  EXPECT_GT(out["head_patch_change"][1].get<double>(), 0.0);
  EXPECT_TRUE(out["head_patch_change"][2].get<bool>());
  // The last layer's resid_post sweep recovers the source's score at the objective's
  // position alone; the z sweep's grid is [layers, heads, positions], v's [layers, KV heads,
  // positions]; all positions of a resid_pre recover all, and all_positions drops the axis.
  const int H = server.model().config.num_heads, KV = server.model().config.num_kv_heads;
  EXPECT_EQ(out["qk_fix"].dump(), absl::StrCat("[true,true,[1,", H, ",6]]"));
  // per_pair: each pair's own grid recovers the same way, and their mean is the mean's
  EXPECT_EQ(out["pairs"].dump(),
            "[[[0.0,0.0,0.0,0.0,0.0,1.0]],2,1,[[[0.0,0.0,0.0,0.0,0.0,1.0]],[[0.0,0.0,0.0,0.0,0.0,"
            "1.0]]],true,true,\"pair_recovered: ask patch_sweep with per_pair=True\"]");
  EXPECT_EQ(out["sweep"].dump(), absl::StrCat("[[[0.0,0.0,0.0,0.0,0.0,1.0]],[1,6],[2,", H, ",3,1,",
                                              H, ",2],[0,1],[2,5],[1,", KV, ",2],[1.0,1.0],[1,", H,
                                              "],[1,", KV, ",6],true,true]"));
  v1::GenerateRequest generate;
  generate.set_text(kChatText);
  generate.mutable_stopping()->set_max_new_tokens(4);
  const StreamResult g = RunGenerate(server.stub(), generate);
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(out["generated"].get<std::vector<int32_t>>(), g.tokens);
  // the rows' shapes from the echoed layers and heads; a row sums to 1; layer 0's head 1
  // asked alone is that entry of every layer's and head's row
  const int L = server.model().config.num_layers;
  ASSERT_EQ(out["rows"][0].size(), 2u);
  const int keys0 = out["rows"][0][0][2].get<int>();  // the prompt's length
  EXPECT_GT(keys0, 1);
  EXPECT_EQ(out["rows"].dump(),
            absl::StrCat("[[[2,1,", keys0, "],[2,1,", keys0 + 1, "]],[[", L, ",", H, ",", keys0,
                         "],[", L, ",", H, ",", keys0 + 1, "]],true,true]"));
  // Sampling, stop strings and min_new_tokens: the client's fields are the C++ stub's.
  {
    v1::GenerateRequest sampled = generate;
    sampled.mutable_stopping()->set_max_new_tokens(6);
    sampled.mutable_stopping()->add_stop("zz");
    sampled.mutable_stopping()->set_min_new_tokens(2);
    v1::SamplingParams* p = sampled.mutable_sampling();
    p->set_temperature(0.9);
    p->set_top_p(0.95);
    p->set_seed(7);
    (*p->mutable_logit_bias())[5] = 2.5f;
    const StreamResult drawn = RunGenerate(server.stub(), sampled);
    ASSERT_TRUE(drawn.status.ok()) << drawn.status.error_message();
    EXPECT_EQ(out["sampled"].get<std::vector<int32_t>>(), drawn.tokens);
    sampled.mutable_sampling()->set_seed(8);  // the seed is what picks these tokens
    EXPECT_NE(RunGenerate(server.stub(), sampled).tokens, drawn.tokens);
  }
  // generate_scored(): the tokens, text and per-token logprobs (and top 2) of the C++ stub's
  // Generate with logprobs, and the finish reason's name.
  {
    v1::GenerateRequest drawn = generate;
    drawn.set_logprobs(true);
    drawn.set_top_logprobs(2);
    drawn.mutable_sampling()->set_temperature(0.9);
    drawn.mutable_sampling()->set_seed(3);
    const StreamResult sr = RunGenerate(server.stub(), drawn);
    ASSERT_TRUE(sr.status.ok()) << sr.status.error_message();
    ASSERT_EQ(sr.logprobs.size(), 4u);
    EXPECT_EQ(out["gs_tokens"].get<std::vector<int32_t>>(), sr.tokens);
    EXPECT_EQ(out["gs_text"].get<std::string>(), sr.text);
    EXPECT_EQ(out["gs_finish"].get<std::string>(), "length");
    const std::vector<double> lps = out["gs_logprobs"].get<std::vector<double>>();
    ASSERT_EQ(lps.size(), 4u);
    double total = 0;
    for (size_t i = 0; i < lps.size(); ++i) {
      EXPECT_EQ(lps[i], sr.logprobs[i].logprob()) << i;
      EXPECT_LT(lps[i], 0.0) << i;
      total += sr.logprobs[i].logprob();
      const std::vector<int32_t> top = out["gs_top"][i].get<std::vector<int32_t>>();
      ASSERT_EQ(top.size(), 2u);
      EXPECT_EQ(top[0], sr.logprobs[i].top(0).token()) << i;
      EXPECT_EQ(top[1], sr.logprobs[i].top(1).token()) << i;
    }
    EXPECT_NEAR(out["gs_total"].get<double>(), total, 1e-9 * std::abs(total));
  }
  // score(): the prompt's tokens, with the C++ stub's prompt_logprobs from position 1.
  {
    v1::GenerateRequest scored;
    scored.set_text(kChatText);
    scored.mutable_stopping()->set_max_new_tokens(1);
    scored.set_prompt_logprobs(2);
    const StreamResult sr = RunGenerate(server.stub(), scored);
    ASSERT_TRUE(sr.status.ok()) << sr.status.error_message();
    ASSERT_EQ(sr.prompt_logprobs.size(), ids.size() - 1);
    EXPECT_EQ(out["score_tokens"].get<std::vector<int32_t>>(), ids);
    const nlohmann::json& lps = out["score_logprobs"];
    ASSERT_EQ(lps.size(), ids.size());
    EXPECT_TRUE(lps[0].is_null());
    double total = 0;
    for (size_t p = 1; p < ids.size(); ++p) {
      EXPECT_EQ(lps[p].get<double>(), sr.prompt_logprobs[p - 1].logprob()) << p;
      total += sr.prompt_logprobs[p - 1].logprob();
      const std::vector<int32_t> top = out["score_top"][p].get<std::vector<int32_t>>();
      ASSERT_EQ(top.size(), 2u);
      EXPECT_EQ(top[0], sr.prompt_logprobs[p - 1].top(0).token()) << p;
      EXPECT_EQ(top[1], sr.prompt_logprobs[p - 1].top(1).token()) << p;
    }
    EXPECT_NEAR(out["score_total"].get<double>(), total, 1e-9 * std::abs(total));
    EXPECT_TRUE(out["score_top"][0].empty());
  }
  // Steering: the client's dicts are the C++ stub's SteeringVectors.
  v1::SteeringVector* v = generate.add_steering();
  v->set_hook("blocks.0.hook_resid_mid");
  for (int i = 0; i < 256; ++i) v->add_vector(0.25f * static_cast<float>(i % 7) - 0.75f);
  v->set_coefficient(3.0f);
  v1::SteeringVector* feature = generate.add_steering();
  feature->set_sae("enc");
  feature->set_feature(2);
  feature->set_coefficient(-20.0f);
  feature->set_start_position(5);
  const StreamResult steered = RunGenerate(server.stub(), generate);
  ASSERT_TRUE(steered.status.ok()) << steered.status.error_message();
  EXPECT_EQ(out["steered"].get<std::vector<int32_t>>(), steered.tokens);
  EXPECT_NE(steered.tokens, g.tokens);

  // run_with_cache and logit_attribution decode what the C++ stubs read.
  const ModelConfig& c = server.model().config;
  EXPECT_EQ(out["cache_keys"].get<std::vector<std::string>>(),
            (std::vector<std::string>{"ln_final", "pattern.1", "z.1"}));
  EXPECT_EQ(out["cache_z_shape"].get<std::vector<int>>(),
            (std::vector<int>{n, c.num_heads, c.head_dim}));
  // TransformerLens's cache["pattern", 1], and a layer from the end, asked for and read.
  EXPECT_TRUE(out["cache_tuple_same"].get<bool>());
  EXPECT_EQ(out["cache_end"].dump(),
            absl::StrCat("[[\"resid_post.", c.num_layers - 1, "\"],true]"));
  // The last layer's last head: grad.q at query head H − 1, grad.k and grad.rot_k at its KV
  // head Hkv − 1 (the last head's group), read back with get(name, -1, -1).
  const int L1 = c.num_layers - 1;
  EXPECT_EQ(out["gp_keys"].get<std::vector<std::string>>(),
            (std::vector<std::string>{
                "grad.embeddings:-1:-1", absl::StrCat("grad.k:", L1, ":", c.num_kv_heads - 1),
                absl::StrCat("grad.q:", L1, ":", c.num_heads - 1),
                absl::StrCat("grad.rot_k:", L1, ":", c.num_kv_heads - 1), "saliency:-1:-1"}));
  EXPECT_EQ(out["gp_same"].dump(), "[true,true,true,true]");
  // hooks= gives a gradient cache keyed and shaped as run_with_cache's; none without it.
  const nlohmann::json& gc = out["grad_cache"];
  EXPECT_EQ(gc[0], gc[1]);
  EXPECT_EQ(gc[0].dump(), absl::StrCat("[\"mlp_post.", L1, "\",\"z.0\"]"));
  EXPECT_EQ(gc[2], gc[3]);
  EXPECT_EQ(gc[2][1].get<int>(), c.hidden_dim);
  EXPECT_EQ(gc[4], gc[5]);
  EXPECT_TRUE(gc[6].get<bool>());
  EXPECT_EQ(out["gh_verify"].dump(),
            absl::StrCat("[[\"residual\",2,true],[\"blocks.", L1,
                         ".mlp.hook_post\",0,true],[\"blocks.0.attn.hook_z\",2,true]]"));
  EXPECT_TRUE(out["gp_rotation"][0].get<bool>());
  EXPECT_GT(out["gp_rotation"][1].get<double>(), 1e-3);  // and they do differ
  // normalized · scale gives back the stream the final norm read (centred under LayerNorm).
  const nlohmann::json& full = out["cache_full"];
  EXPECT_EQ(full[0].dump(),
            absl::StrCat("[\"ln_final_normalized\",\"ln_final_scale\",\"pattern.1\","
                         "\"resid_post.",
                         c.num_layers - 1, "\"]"));
  EXPECT_TRUE(full[1].get<bool>());
  EXPECT_LE(full[2].get<double>(), 1e-12);
  EXPECT_TRUE(full[3].get<bool>());
  EXPECT_FALSE(full[4].get<bool>());
  // The embeddings (GPT-2: and positions), 21 hooks a layer (GPT-2: 18, without rot_q,
  // rot_k and mlp_pre_linear), then the final norm's two.
  const bool rotary = c.arch == Architecture::kLlama;
  EXPECT_EQ(out["hook_names"].dump(),
            absl::StrCat("[", (rotary ? 21 : 18) * c.num_layers + (rotary ? 3 : 4),
                         ",\"hook_embed\",\"ln_final.hook_normalized\",",
                         rotary ? 2 * c.num_layers : 0, "]"));
  // TransformerLens's stacks: labels as its, and the parts add up (this model has no
  // biases and no block-output norms, so its heads' results sum to attn_out).
  ASSERT_EQ(c.num_layers, 2);
  const nlohmann::json& st = out["stacks"];
  EXPECT_EQ(st["acc_labels"].dump(), "[\"0_pre\",\"1_pre\",\"final_post\"]");
  EXPECT_EQ(st["dec_labels"].dump(),
            "[\"embed\",\"0_attn_out\",\"0_mlp_out\",\"1_attn_out\",\"1_mlp_out\"]");
  EXPECT_EQ(st["head_labels"].dump(), "[\"L0H0\",\"L0H1\"]");
  EXPECT_EQ(st["acc_last"].get<double>(), 0.0);
  for (const char* k : {"dec_sum", "ln_final", "ln1", "heads"}) {
    EXPECT_LE(st[k].get<double>(), 1e-12) << k;
  }
  EXPECT_EQ(out["aliases"].dump(),
            "[true,true,\"ln_final.hook_normalized\",\"blocks.0.mlp.hook_pre_linear\",true,"
            "\"absent\"]");
  EXPECT_EQ(
      st["heads_shape"].dump(),
      absl::StrCat("[", c.num_heads, ",", out["cache_z_shape"][0].get<int>(), ",", c.dim, "]"));
  std::string pattern_keys;
  for (int l = 0; l < c.num_layers; ++l) {
    absl::StrAppend(&pattern_keys, l ? "," : "", "\"pattern.", l, "\"");
  }
  EXPECT_EQ(out["filtered"].dump(), absl::StrCat("[[", pattern_keys, "],true]"));
  EXPECT_EQ(out["filtered_one"].dump(), "[\"mlp_out.0\"]");
  EXPECT_EQ(out["filter_none"].get<std::string>(), "run_with_cache: names_filter chooses no hook");
  // The pattern head first, as TransformerLens's: its fp64 row is AttentionMaps' fp32 one.
  EXPECT_EQ(out["cache_pattern_shape"].get<std::vector<int>>(),
            (std::vector<int>{c.num_heads, n, n}));
  const std::vector<double> pattern_row = out["cache_pattern_row"].get<std::vector<double>>();
  ASSERT_EQ(pattern_row.size(), static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    EXPECT_NEAR(pattern_row[k], want.probs[static_cast<size_t>(n - 1) * n + k], 1e-5) << k;
  }
  v1::ActivationsRequest acts;
  *acts.mutable_input() = IdsInput(ids);
  acts.add_hooks("z");
  acts.add_layers(1);
  acts.mutable_positions()->set_begin(n - 1);
  acts.set_precision(v1::PRECISION_FP64);
  v1::ActivationsResponse a;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(InterpretStub(server)->Activations(&context, acts, &a).ok());
  }
  const std::vector<double> z = DecodeTensor(a.tensors(0));
  EXPECT_EQ(out["cache_z_row"].get<std::vector<double>>(),
            std::vector<double>(z.begin() + 2 * c.head_dim, z.begin() + 3 * c.head_dim));
  v1::LogitAttributionRequest dla;
  *dla.mutable_input() = IdsInput(ids);
  dla.set_token(5);
  v1::LogitAttributionResponse d;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(InterpretStub(server)->LogitAttribution(&context, dla, &d).ok());
  }
  EXPECT_EQ(out["dla_logit"].get<double>(), d.logit());
  EXPECT_EQ(out["dla_total"].get<double>(), d.total());
  EXPECT_EQ(out["dla_heads"].get<int>(), c.num_layers * (c.num_heads + 1));
  EXPECT_EQ(out["saes"].get<std::vector<std::string>>(), std::vector<std::string>{"enc"});
  v1::SaeFeaturesRequest sr;
  *sr.mutable_input() = IdsInput(ids);
  sr.set_top_k(3);
  sr.add_feature_ids(1);
  v1::SaeFeaturesResponse sf;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(InterpretStub(server)->SaeFeatures(&context, sr, &sf).ok());
  }
  ASSERT_EQ(out["sae_l0"].size(), static_cast<size_t>(sf.rows_size()));
  for (int i = 0; i < sf.rows_size(); ++i) {
    EXPECT_EQ(out["sae_l0"][i].get<int>(), sf.rows(i).l0());
    std::vector<int> top;
    for (const v1::SaeFeature& f : sf.rows(i).top()) top.push_back(f.index());
    EXPECT_EQ(out["sae_top"][i].get<std::vector<int>>(), top);
    EXPECT_EQ(out["sae_f1"][i].get<double>(), sf.rows(i).features(0));
  }
}

// Sessions and the cached-KV probe from Python: generate(session_id=...) twice on a
// session opened by `with client.session()`, then cached_kv_probe on it; the C++ stubs
// doing the same on a second session get the same tokens, J, P and every gradient entry.
// Leaving the `with` closes the session: a Generate on it fails as on a closed one.
constexpr char kSessionScript[] = R"(
import json, sys
from kvlens import Client
c = Client(sys.argv[1])
out = {}
with c.session() as sid:
    out["first"] = c.generate(text="Once upon a time", max_new_tokens=4, session_id=sid)[0]
    out["second"] = c.generate_scored(tokens=[29, 30], max_new_tokens=3, session_id=sid).tokens
    kv = c.cached_kv_probe(sid, [31, 32], target=33)
    out["objective"], out["cached"], out["precision"] = kv.objective, kv.num_cached, kv.precision
    out["k"] = {str(l): a.ravel().tolist() for l, a in kv.tensors["grad.cached_k"].items()}
    out["v"] = {str(l): a.ravel().tolist() for l, a in kv.tensors["grad.cached_v"].items()}
    out["k0_shape"] = list(kv.get("grad.cached_k", 0).shape)
    out["k_last"] = bool((kv.get("grad.cached_k", -1)
                          == kv.tensors["grad.cached_k"][max(kv.tensors["grad.cached_k"])]).all())
    out["sid"] = sid
try:
    c.generate(tokens=[5], max_new_tokens=1, session_id=out["sid"])
    out["closed"] = "OK"
except Exception as e:
    out["closed"] = e.code().name
print(json.dumps(out))
)";

TEST(PythonClient, SessionsAndTheCachedKvProbeEqualTheCppStubs) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  nlohmann::json out;
  ASSERT_TRUE(RunScript("kvlens_python_session_test.py", kSessionScript, server.address(), &out));

  v1::OpenSessionResponse session;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(server.stub().OpenSession(&context, {}, &session).ok());
  }
  EXPECT_NE(session.session_id(), out["sid"].get<int64_t>());
  v1::GenerateRequest first = GreedyRequest("Once upon a time", 4);
  first.set_session_id(session.session_id());
  const StreamResult a = RunGenerate(server.stub(), first);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  EXPECT_EQ(out["first"].get<std::vector<int32_t>>(), a.tokens);
  v1::GenerateRequest second;
  second.mutable_token_ids()->add_ids(29);
  second.mutable_token_ids()->add_ids(30);
  second.mutable_stopping()->set_max_new_tokens(3);
  second.set_session_id(session.session_id());
  const StreamResult b = RunGenerate(server.stub(), second);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(out["second"].get<std::vector<int32_t>>(), b.tokens);

  v1::CachedKvProbeRequest probe;
  probe.set_session_id(session.session_id());
  probe.add_new_tokens(31);
  probe.add_new_tokens(32);
  probe.set_target(33);
  v1::CachedKvProbeResponse r;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    const grpc::Status s = InterpretStub(server)->CachedKvProbe(&context, probe, &r);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(out["objective"].get<double>(), r.objective());
  EXPECT_LT(r.objective(), 0.0);  // a log-probability
  EXPECT_EQ(out["cached"].get<int>(), r.num_cached());
  EXPECT_EQ(out["precision"].get<std::string>(), "PRECISION_FP32");
  const ModelConfig& c = server.model().config;
  EXPECT_EQ(out["k0_shape"].get<std::vector<int>>(),
            (std::vector<int>{r.num_cached(), static_cast<int>(c.num_kv_heads * c.head_dim)}));
  EXPECT_TRUE(out["k_last"].get<bool>());  // get(…, -1): the last layer's
  int tensors = 0;
  for (const v1::Tensor& t : r.tensors()) {
    const std::string key = t.name() == "grad.cached_k" ? "k" : "v";
    EXPECT_EQ(out[key][absl::StrCat(t.layer())].get<std::vector<double>>(), DecodeTensor(t))
        << t.name() << " " << t.layer();
    ++tensors;
  }
  EXPECT_EQ(tensors, 2 * c.num_layers);
  EXPECT_EQ(out["k"].size() + out["v"].size(), static_cast<size_t>(tensors));

  v1::CloseSessionRequest close;
  close.set_session_id(session.session_id());
  v1::CloseSessionResponse closed;
  {
    grpc::ClientContext context;
    SetDeadline(context);
    ASSERT_TRUE(server.stub().CloseSession(&context, close, &closed).ok());
  }
  v1::GenerateRequest after = GreedyRequest("x", 1);
  after.set_session_id(session.session_id());
  const StreamResult gone = RunGenerate(server.stub(), after);
  ASSERT_FALSE(gone.status.ok());
  EXPECT_EQ(out["closed"].get<std::string>(),
            absl::StatusCodeToString(static_cast<absl::StatusCode>(gone.status.error_code())));
}

// generate_stream(): the chunks as they arrive, which together are the C++ stub's greedy
// tokens and text, the finish reason on the last; closed after its first chunk, the
// stream is cancelled: the server counts a CANCELLED Generate (a short stream may finish
// first, so up to 10 tries) and frees every block. And ignore_eos.
constexpr char kStreamScript[] = R"(
import json, sys, time, urllib.request
from kvlens import Client
c = Client(sys.argv[1])
series = 'kvlens_requests_total{code="CANCELLED",rpc="Generate"} '
def cancelled():
    body = urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[2]).read().decode()
    return sum(float(l.split()[-1]) for l in body.splitlines() if l.startswith(series))
chunks = list(c.generate_stream(text="Once upon a time", max_new_tokens=8))
out = {"tokens": [t for ch in chunks for t in ch.tokens], "text": "".join(ch.text for ch in chunks),
       "finish": [ch.finish_reason for ch in chunks], "tries": 0}
while out["tries"] < 10 and cancelled() < 1:
    out["tries"] += 1
    s = c.generate_stream(text="Once upon a time", max_new_tokens=110, ignore_eos=True)
    out["first"] = next(s).tokens
    s.close()
    deadline = time.time() + 5
    while time.time() < deadline and cancelled() < 1:
        time.sleep(0.01)
out["cancelled"] = cancelled()
eos = c.model_info().eos_id
forced = {"logit_bias": {eos: 100}}
out["eos_ignored"] = c.generate(text="Once", max_new_tokens=5, sampling=forced, ignore_eos=True)[0]
g = c.generate_scored(text="Once", max_new_tokens=5, sampling=forced)
out["eos_kept"], out["eos_finish"] = g.tokens, g.finish_reason
print(json.dumps(out))
)";

TEST(PythonClient, StreamsChunksAndCancelsWhenClosed) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  nlohmann::json out;
  ASSERT_TRUE(RunScript("kvlens_python_stream_test.py", kStreamScript,
                        absl::StrCat(server.address(), " ", server.metrics_port()), &out));
  const StreamResult want = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 8));
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_EQ(want.tokens.size(), 8u);
  EXPECT_EQ(out["tokens"].get<std::vector<int32_t>>(), want.tokens);
  EXPECT_EQ(out["text"].get<std::string>(), want.text);
  // A reader the server outpaces gets its tokens, and even the finish, coalesced: one chunk
  // or several, the finish reason on the last alone.
  const nlohmann::json& finish = out["finish"];
  ASSERT_GE(finish.size(), 1u);
  for (size_t i = 0; i + 1 < finish.size(); ++i) EXPECT_TRUE(finish[i].is_null()) << i;
  EXPECT_EQ(finish.back().get<std::string>(), "length");
  EXPECT_GE(out["first"].get<std::vector<int32_t>>().size(), 1u);  // a chunk may hold several
  EXPECT_GE(out["cancelled"].get<double>(), 1.0) << "after " << out["tries"] << " tries";
  bool freed = false;
  for (int i = 0; i < 500 && !freed; ++i) {
    const EngineStats stats = server.engine().Stats();
    freed = stats.running == 0 && stats.blocks_used == 0;
    if (!freed) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(freed) << "blocks in use: " << server.engine().Stats().blocks_used;
  // EOS forced by its logit bias: generate(ignore_eos=True) keeps drawing it to the
  // limit; without, the output is that one EOS.
  const int32_t eos = server.model().tokenizer->eos_id();
  EXPECT_EQ(out["eos_ignored"].get<std::vector<int32_t>>(), std::vector<int32_t>(5, eos));
  EXPECT_EQ(out["eos_kept"].get<std::vector<int32_t>>(), std::vector<int32_t>{eos});
  EXPECT_EQ(out["eos_finish"].get<std::string>(), "eos");
}

// The committed Python stubs (clients/python/kvlens/v1) are what protoc makes of today's
// protos: an edited proto without a regenerate.py run fails here, naming the file.
TEST(PythonClient, StubsMatchTheProtos) {
  const auto [code, output] = RunCommand(absl::StrCat(
      "/usr/bin/python3 ", KVLENS_SOURCE_DIR, "/clients/python/kvlens/regenerate.py --check 2>&1"));
  EXPECT_EQ(code, 0) << output;
  EXPECT_NE(output.find("stubs match the protos"), std::string::npos) << output;
}

}  // namespace
}  // namespace kvlens::testing
