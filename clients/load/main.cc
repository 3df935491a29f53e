// kvlens-load: a load generator for kvlens-server that measures streaming gRPC per token.
// Closed loop (N concurrent streams) or open loop (Poisson arrivals), synthetic or file
// prompts, an optional share of interpretability calls; reports client-side latency and
// throughput with the server's own metrics scraped before and after. See
// docs/load-testing.md.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "clients/load/http_get.h"
#include "clients/load/prom_text.h"
#include "clients/load/report.h"
#include "clients/load/runner.h"
#include "clients/load/workload.h"
#include "common/flag_names.h"

ABSL_FLAG(std::string, server, "127.0.0.1:50051",
          "kvlens-server gRPC address(es), HOST:PORT, comma-separated; requests go "
          "round-robin over them. dns:///NAME:PORT (e.g. a Kubernetes headless Service) "
          "balances over every address NAME resolves to.");
ABSL_FLAG(std::string, metrics, "",
          "Metrics endpoint(s) HOST:PORT to scrape /metrics from before and after the run "
          "(and once a second for gauge peaks), comma-separated; several are summed. Empty: "
          "each --server host on port 9464 (with dns:/// only the first address NAME "
          "resolves to answers: list the pods' endpoints instead). 'none': do not scrape.");
ABSL_FLAG(std::string, mode, "closed",
          "closed: keep --concurrency requests in flight. open: start requests at Poisson "
          "arrival times of --rate per second, whatever the server's pace.");
ABSL_FLAG(int32_t, concurrency, 4, "Closed loop: concurrent streams.");
ABSL_FLAG(double, rate, 4, "Open loop: mean arrivals per second.");
ABSL_FLAG(int32_t, max_in_flight, 256,
          "Open loop: requests in flight at most; arrivals beyond it are dropped and counted.");
ABSL_FLAG(int64_t, requests, 1000,
          "Measured requests to start at most (the run also ends at --duration).");
ABSL_FLAG(absl::Duration, duration, absl::Seconds(60),
          "Measured phase length at most (e.g. 20s, 5m); starts stop then, in-flight "
          "requests get --drain-timeout to finish.");
ABSL_FLAG(int32_t, warmup, 0,
          "Warm-up requests before measuring (same mode and workload; not reported). Also "
          "bounded by --duration.");
ABSL_FLAG(std::string, prompt_tokens, "64",
          "Synthetic prompt length: N tokens, or MIN:MAX (uniform). Random token ids.");
ABSL_FLAG(int32_t, shared_prefix_tokens, 0,
          "Leading tokens every synthetic prompt shares (exercises the prefix cache).");
ABSL_FLAG(int32_t, turns, 1,
          "Turns of a conversation (synthetic prompts): each turn after the first is sent when "
          "the previous one ends, its prompt the previous prompt, the token ids it generated "
          "and --turn-tokens new ones, as a chat client resends a conversation (the server's "
          "prefix cache holds the earlier turns). A conversation that could pass the context "
          "ends early; new ones start as slots free up.");
ABSL_FLAG(std::string, turn_tokens, "16",
          "New user tokens each turn after the first adds: N, or MIN:MAX (uniform).");
ABSL_FLAG(std::string, prompts_file, "",
          "Text prompts, one per line (\\n inside a line for a newline), used in turn "
          "instead of synthetic ones.");
ABSL_FLAG(std::string, output_tokens, "64",
          "Tokens to generate per request (max_new_tokens): N, or MIN:MAX (uniform).");
ABSL_FLAG(bool, ignore_eos, true,
          "Generate the full --output-tokens even past EOS (fixed output lengths).");
ABSL_FLAG(double, temperature, 0, "Sampling temperature (0: greedy).");
ABSL_FLAG(int32_t, prompt_logprobs, -1,
          "Generate requests also score their prompt (prompt_logprobs) with this many top "
          "tokens a position, 0 … 20 (an evaluation workload: with --output-tokens 1); -1: off.");
ABSL_FLAG(double, attention_share, 0,
          "Share of requests in [0, 1] that are AttentionMaps calls (every layer and head "
          "of the prompt).");
ABSL_FLAG(double, probe_share, 0,
          "Share of requests in [0, 1] that are GradientProbe calls (log p of the last "
          "prompt token; input-embedding gradients).");
ABSL_FLAG(double, activations_share, 0,
          "Share of requests in [0, 1] that are Activations calls (the residual stream "
          "entering every layer, run_with_cache's resid_pre).");
ABSL_FLAG(double, attribution_share, 0,
          "Share of requests in [0, 1] that are LogitAttribution calls (the last prompt "
          "token's logit, split by layer and head).");
ABSL_FLAG(double, patch_share, 0,
          "Share of requests in [0, 1] that are PatchSweep calls (every head's z in the last "
          "layer patched at all positions from the prompt reversed, scored by log p of the "
          "last prompt token).");
ABSL_FLAG(uint64_t, seed, 0,
          "Seed of prompts, lengths, arrivals and sampling; the report records it. 0: a "
          "fresh one per run, so a repeated run does not find its prompts in the server's "
          "prefix cache (pass the recorded seed to repeat a run exactly).");
ABSL_FLAG(absl::Duration, request_timeout, absl::Seconds(120), "Deadline of each request.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "After the last start, how long in-flight requests may finish before they are "
          "cancelled.");
ABSL_FLAG(absl::Duration, connect_timeout, absl::Seconds(15),
          "How long to wait for the first server to answer GetModelInfo.");
ABSL_FLAG(std::string, json_out, "", "Also write the JSON report to this file.");
ABSL_FLAG(bool, progress, true, "Show a progress bar (only when stderr is a terminal).");

namespace kvlens::load {
namespace {

constexpr char kUsage[] =
    "kvlens-load [--server HOST:PORT] [--mode closed|open] [flags]\n\n"
    "Load-tests a kvlens-server over streaming gRPC and reports request and token "
    "throughput, time to first token, inter-token and end-to-end latency (mean, p50, p90, "
    "p99), errors by status code, and the server's cache and batch metrics (scraped before "
    "and after) as a table and as one JSON line. Every run ends by itself (--requests, "
    "--duration, --drain-timeout). Flag names take '-' or '_' alike. Exit: 0 done, 1 no "
    "server or every request failed, 2 bad flags.";

int Fail(const absl::Status& s, int code) {
  std::fprintf(stderr, "kvlens-load: %s\n", std::string(s.message()).c_str());
  return code;
}

std::vector<std::string> SplitList(const std::string& s) {
  return absl::StrSplit(s, ',', absl::SkipWhitespace());
}

std::chrono::milliseconds Ms(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Scrapes every endpoint and concatenates their samples (so sums add replicas).
MetricSnapshot Scrape(const std::vector<std::string>& endpoints, bool warn) {
  std::vector<PromSample> all;
  for (const std::string& e : endpoints) {
    std::string host;
    int port = 0;
    absl::StatusOr<std::vector<PromSample>> samples;
    if (absl::Status s = SplitHostPort(e, host, port); !s.ok()) {
      samples = s;
    } else if (absl::StatusOr<std::string> body =
                   HttpGet(host, port, "/metrics", std::chrono::seconds(5));
               !body.ok()) {
      samples = body.status();
    } else {
      samples = ParsePromText(*body);
    }
    if (!samples.ok()) {
      if (warn) {
        std::fprintf(stderr, "kvlens-load: metrics %s: %s\n", e.c_str(),
                     std::string(samples.status().message()).c_str());
      }
      return MetricSnapshot();
    }
    all.insert(all.end(), samples->begin(), samples->end());
  }
  return MetricSnapshot(std::move(all));
}

// One line on stderr, redrawn in place: [####------]  43%  430/1000 req  8.6/20.0 s ...
void DrawProgress(const Progress& p, int64_t requests, double duration_s, bool final_line) {
  const double frac = std::clamp(
      std::max(static_cast<double>(p.started) / requests, p.elapsed_seconds / duration_s), 0.0,
      1.0);
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kWidth - filled), '-');
  const double tps = p.elapsed_seconds > 0 ? p.output_tokens / p.elapsed_seconds : 0;
  std::fprintf(
      stderr,
      "\r\033[K[%s] %3.0f%%  %lld/%lld req  %.1f/%.0f s  in flight %d  %.1f tok/s  errors %lld%s",
      bar.c_str(), frac * 100, static_cast<long long>(p.finished), static_cast<long long>(requests),
      p.elapsed_seconds, duration_s, p.in_flight, tps, static_cast<long long>(p.errors),
      final_line ? "\n" : "");
  std::fflush(stderr);
}

int Main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  absl::FlagsUsageConfig usage_config;
  usage_config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "clients/load/main.cc");
  };
  usage_config.contains_helpshort_flags = usage_config.contains_help_flags;
  absl::SetFlagsUsageConfig(usage_config);
  std::vector<std::string> storage;
  std::vector<char*> args = kvlens::NormalizeFlagNames(argc, argv, storage);
  const std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    return Fail(absl::InvalidArgumentError(
                    absl::StrCat("unexpected argument '", positional[1], "' (see --help)")),
                2);
  }

  // Flags → options, every value checked and named.
  PhaseOptions phase;
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "closed" && mode != "open") {
    return Fail(absl::InvalidArgumentError("--mode must be closed or open"), 2);
  }
  phase.mode = mode == "open" ? Mode::kOpen : Mode::kClosed;
  phase.concurrency = absl::GetFlag(FLAGS_concurrency);
  phase.rate = absl::GetFlag(FLAGS_rate);
  phase.max_in_flight = absl::GetFlag(FLAGS_max_in_flight);
  phase.requests = absl::GetFlag(FLAGS_requests);
  phase.duration = Ms(absl::GetFlag(FLAGS_duration));
  phase.drain = Ms(absl::GetFlag(FLAGS_drain_timeout));
  phase.request_timeout = Ms(absl::GetFlag(FLAGS_request_timeout));
  phase.seed = absl::GetFlag(FLAGS_seed);
  if (phase.seed == 0)
    phase.seed = (uint64_t{std::random_device()()} << 32) | std::random_device()();
  const int warmup = absl::GetFlag(FLAGS_warmup);
  std::string bad;
  if (phase.concurrency < 1 || phase.concurrency > 100000)
    bad = "--concurrency must be in [1, 100000]";
  if (!(phase.rate > 0 && phase.rate <= 1e6)) bad = "--rate must be in (0, 1e6] requests/s";
  if (phase.max_in_flight < 1) bad = "--max-in-flight must be >= 1";
  if (phase.requests < 1) bad = "--requests must be >= 1";
  if (phase.duration.count() <= 0) bad = "--duration must be positive";
  if (phase.drain.count() < 0) bad = "--drain-timeout must be >= 0";
  if (phase.request_timeout.count() <= 0) bad = "--request-timeout must be positive";
  if (warmup < 0) bad = "--warmup must be >= 0";
  const double attention_share = absl::GetFlag(FLAGS_attention_share);
  const double probe_share = absl::GetFlag(FLAGS_probe_share);
  const double activations_share = absl::GetFlag(FLAGS_activations_share);
  const double attribution_share = absl::GetFlag(FLAGS_attribution_share);
  const double patch_share = absl::GetFlag(FLAGS_patch_share);
  const double interp_share =
      attention_share + probe_share + activations_share + attribution_share + patch_share;
  if (!(attention_share >= 0 && probe_share >= 0 && activations_share >= 0 &&
        attribution_share >= 0 && patch_share >= 0 && interp_share <= 1)) {
    bad =
        "--attention-share, --probe-share, --activations-share, --attribution-share and "
        "--patch-share must be >= 0 with a sum <= 1";
  }
  if (interp_share > 0 && !InterpretSupported()) {
    bad =
        "this kvlens-load was built without interpret.proto: --attention-share, "
        "--probe-share, --activations-share, --attribution-share and --patch-share are "
        "unavailable";
  }
  if (absl::GetFlag(FLAGS_shared_prefix_tokens) < 0) bad = "--shared-prefix-tokens must be >= 0";
  if (absl::GetFlag(FLAGS_turns) < 1) bad = "--turns must be >= 1";
  if (absl::GetFlag(FLAGS_turns) > 1 && !absl::GetFlag(FLAGS_prompts_file).empty()) {
    bad = "--turns > 1 needs synthetic prompts (not --prompts-file)";
  }
  if (const int p = absl::GetFlag(FLAGS_prompt_logprobs); p < -1 || p > 20) {
    bad = "--prompt-logprobs must be in [0, 20], or -1 (off)";
  }
  if (!bad.empty()) return Fail(absl::InvalidArgumentError(bad), 2);

  WorkloadOptions wo;
  auto prompt_len = LengthDist::Parse(absl::GetFlag(FLAGS_prompt_tokens), "prompt-tokens");
  auto output_len = LengthDist::Parse(absl::GetFlag(FLAGS_output_tokens), "output-tokens");
  auto turn_len = LengthDist::Parse(absl::GetFlag(FLAGS_turn_tokens), "turn-tokens");
  if (!prompt_len.ok()) return Fail(prompt_len.status(), 2);
  if (!output_len.ok()) return Fail(output_len.status(), 2);
  if (!turn_len.ok()) return Fail(turn_len.status(), 2);
  wo.prompt_tokens = *prompt_len;
  wo.output_tokens = *output_len;
  wo.turns = absl::GetFlag(FLAGS_turns);
  wo.turn_tokens = *turn_len;
  if (!absl::GetFlag(FLAGS_prompts_file).empty()) {
    auto prompts = ReadPromptsFile(absl::GetFlag(FLAGS_prompts_file));
    if (!prompts.ok()) return Fail(prompts.status(), 2);
    wo.prompts = *std::move(prompts);
  }
  wo.shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_tokens);
  wo.temperature = absl::GetFlag(FLAGS_temperature);
  wo.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  wo.prompt_logprobs = absl::GetFlag(FLAGS_prompt_logprobs);
  wo.attention_share = attention_share;
  wo.probe_share = probe_share;
  wo.activations_share = activations_share;
  wo.attribution_share = attribution_share;
  wo.patch_share = patch_share;
  wo.seed = phase.seed;

  const std::vector<std::string> addresses = SplitList(absl::GetFlag(FLAGS_server));
  if (addresses.empty()) return Fail(absl::InvalidArgumentError("--server is empty"), 2);
  std::vector<std::string> metrics_endpoints;
  const std::string metrics_flag = absl::GetFlag(FLAGS_metrics);
  for (const std::string& a : addresses) {
    std::string host;
    int port = 0;
    const std::string target = absl::StartsWith(a, "dns:///") ? a.substr(7) : a;
    if (absl::Status s = SplitHostPort(target, host, port); !s.ok()) return Fail(s, 2);
    if (metrics_flag.empty()) {
      metrics_endpoints.push_back(absl::StrCat(
          host.find(':') != std::string::npos ? absl::StrCat("[", host, "]") : host, ":9464"));
    }
  }
  if (!metrics_flag.empty() && metrics_flag != "none") metrics_endpoints = SplitList(metrics_flag);

  // The model bounds synthetic prompts: ids below its vocabulary, lengths within context.
  std::vector<ServerStubs> servers;
  for (const std::string& a : addresses) servers.push_back(MakeStubs(a));
  v1::ModelInfo info;
  {
    grpc::ClientContext context;
    context.set_wait_for_ready(true);
    context.set_deadline(std::chrono::system_clock::now() +
                         Ms(absl::GetFlag(FLAGS_connect_timeout)));
    const grpc::Status s = servers[0].generation->GetModelInfo(&context, {}, &info);
    if (!s.ok()) {
      return Fail(absl::UnavailableError(
                      absl::StrCat("GetModelInfo on ", addresses[0], ": ", s.error_message())),
                  1);
    }
  }
  wo.vocab_size = info.vocab_size();
  wo.context_length = info.context_length();
  if (wo.prompts.empty() && wo.prompt_tokens.max + wo.output_tokens.max > info.context_length()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--prompt-tokens max ", wo.prompt_tokens.max, " + --output-tokens max ",
                    wo.output_tokens.max, " exceeds the model's context of ", info.context_length(),
                    " tokens")),
                2);
  }
  Workload workload(wo);
  Runner runner(&servers, &workload);

  const bool show_progress = absl::GetFlag(FLAGS_progress) && isatty(STDERR_FILENO);
  if (warmup > 0) {
    PhaseOptions w = phase;
    w.requests = warmup;
    w.seed = phase.seed ^ 0x9e3779b97f4a7c15ULL;
    if (show_progress) std::fprintf(stderr, "kvlens-load: warm-up (%d requests)\n", warmup);
    const PhaseResult warm = runner.Run(w);
    std::fprintf(stderr, "kvlens-load: warm-up done: %zu requests in %.1f s\n", warm.calls.size(),
                 warm.elapsed_seconds);
  }

  const MetricSnapshot before =
      metrics_endpoints.empty() ? MetricSnapshot() : Scrape(metrics_endpoints, true);
  GaugePeaks peaks;
  std::atomic<bool> sampling{!before.empty()};
  std::mutex peaks_mu;
  std::thread sampler([&] {
    while (sampling.load()) {
      MetricSnapshot now = Scrape(metrics_endpoints, false);
      {
        std::lock_guard<std::mutex> lock(peaks_mu);
        peaks.Observe(now);
      }
      for (int i = 0; i < 10 && sampling.load(); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  });
  const double duration_s = static_cast<double>(phase.duration.count()) / 1e3;
  Progress last_progress;
  std::mutex progress_mu;
  const PhaseResult result = runner.Run(
      phase, show_progress ? std::function<void(const Progress&)>([&](const Progress& p) {
        std::lock_guard<std::mutex> lock(progress_mu);
        last_progress = p;
        DrawProgress(p, phase.requests, duration_s, false);
      })
                           : nullptr);
  if (show_progress) {
    last_progress.finished = static_cast<int64_t>(result.calls.size());
    last_progress.in_flight = 0;
    DrawProgress(last_progress, phase.requests, duration_s, true);
  }
  sampling.store(false);
  sampler.join();
  const MetricSnapshot after = before.empty() ? MetricSnapshot() : Scrape(metrics_endpoints, true);

  nlohmann::json config = {
      {"servers", addresses},
      {"model", info.name()},
      {"backend", info.backend()},
      {"mode", mode},
      {"concurrency",
       phase.mode == Mode::kClosed ? nlohmann::json(phase.concurrency) : nlohmann::json(nullptr)},
      {"rate", phase.mode == Mode::kOpen ? nlohmann::json(phase.rate) : nlohmann::json(nullptr)},
      {"requests", phase.requests},
      {"duration_seconds", duration_s},
      {"warmup", warmup},
      {"prompt_tokens", wo.prompts.empty() ? absl::GetFlag(FLAGS_prompt_tokens) : "file"},
      {"output_tokens", absl::GetFlag(FLAGS_output_tokens)},
      {"shared_prefix_tokens", wo.shared_prefix_tokens},
      {"turns", wo.turns},
      {"turn_tokens", absl::GetFlag(FLAGS_turn_tokens)},
      {"attention_share", attention_share},
      {"probe_share", probe_share},
      {"activations_share", activations_share},
      {"attribution_share", attribution_share},
      {"patch_share", patch_share},
      {"seed", phase.seed}};
  Report report = BuildReport(result, std::move(config));
  if (!before.empty() && !after.empty()) {
    report.server_metrics = true;
    report.server = BuildServerSection(before, after, peaks);
  }
  const std::string json_line = ToJson(report).dump();
  std::cout << FormatTable(report) << json_line << std::endl;
  if (const std::string path = absl::GetFlag(FLAGS_json_out); !path.empty()) {
    std::ofstream out(path);
    out << json_line << "\n";
    if (!out) return Fail(absl::InternalError(absl::StrCat("cannot write --json-out ", path)), 1);
  }
  int64_t successes = report.ok;
  for (const auto& [kind, k] : report.interpret) successes += k.ok;
  if (report.errors > 0 && successes == 0) {
    return Fail(
        absl::UnavailableError(absl::StrCat("every request failed; first: ", report.first_error)),
        1);
  }
  return 0;
}

}  // namespace
}  // namespace kvlens::load

int main(int argc, char** argv) { return kvlens::load::Main(argc, argv); }
