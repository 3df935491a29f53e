#include "clients/load/report.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvlens::load {
namespace {

using nlohmann::json;

json SummaryJson(const Summary& s, double scale) {
  return {{"count", s.count},     {"mean", s.mean * scale}, {"p50", s.p50 * scale},
          {"p90", s.p90 * scale}, {"p99", s.p99 * scale},   {"max", s.max * scale}};
}

// sum delta ÷ count delta of a histogram; null when nothing was observed.
json HistogramMean(const MetricSnapshot& before, const MetricSnapshot& after,
                   const std::string& name) {
  const double count = after.Sum(name + "_count") - before.Sum(name + "_count");
  if (count <= 0) return nullptr;
  return (after.Sum(name + "_sum") - before.Sum(name + "_sum")) / count;
}

json Delta(const MetricSnapshot& before, const MetricSnapshot& after, const std::string& name) {
  return after.Sum(name) - before.Sum(name);
}

std::string Ms(const Summary& s, double v) {
  return s.count == 0 ? std::string("-") : absl::StrFormat("%.1f", v * 1e3);
}

std::string NumOrDash(const json& j, const char* fmt_kind) {
  if (j.is_null()) return "-";
  const double v = j.get<double>();
  if (std::string(fmt_kind) == "ms") return absl::StrFormat("%.1f ms", v * 1e3);
  if (std::string(fmt_kind) == "pct") return absl::StrFormat("%.1f%%", v * 100);
  if (std::string(fmt_kind) == "int") return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.2f", v);
}

}  // namespace

std::string GrpcCodeName(grpc::StatusCode code) {
  static constexpr const char* kNames[] = {"OK",
                                           "CANCELLED",
                                           "UNKNOWN",
                                           "INVALID_ARGUMENT",
                                           "DEADLINE_EXCEEDED",
                                           "NOT_FOUND",
                                           "ALREADY_EXISTS",
                                           "PERMISSION_DENIED",
                                           "RESOURCE_EXHAUSTED",
                                           "FAILED_PRECONDITION",
                                           "ABORTED",
                                           "OUT_OF_RANGE",
                                           "UNIMPLEMENTED",
                                           "INTERNAL",
                                           "UNAVAILABLE",
                                           "DATA_LOSS",
                                           "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return i >= 0 && i < 17 ? kNames[i] : absl::StrCat("CODE_", i);
}

void GaugePeaks::Observe(const MetricSnapshot& m) {
  if (m.empty()) return;
  running = std::max(running, m.Sum("kvlens_running_requests"));
  waiting = std::max(waiting, m.Sum("kvlens_waiting_requests"));
  kv_cache_usage = std::max(kv_cache_usage, m.Sum("kvlens_kv_cache_usage_ratio"));
  ++samples;
}

Report BuildReport(const PhaseResult& phase, json config) {
  Report r;
  r.config = std::move(config);
  r.elapsed_seconds = phase.elapsed_seconds;
  r.started = phase.started;
  r.dropped = phase.dropped;
  r.cancelled_at_drain = phase.cancelled_at_drain;
  std::vector<double> ttft, itl, e2e;
  std::map<std::string, std::vector<double>> kind_latency, kind_first;
  int64_t ok_calls = 0;
  for (const CallResult& c : phase.calls) {
    const bool ok = c.code == grpc::StatusCode::OK;
    if (!ok) {
      ++r.errors;
      ++r.errors_by_code[GrpcCodeName(c.code)];
      if (r.first_error.empty()) {
        r.first_error = absl::StrCat(KindName(c.kind), ": ", GrpcCodeName(c.code), ": ", c.message);
      }
    } else {
      ++ok_calls;
    }
    if (c.kind != Kind::kGenerate) {
      KindStats& k = r.interpret[KindName(c.kind)];
      ok ? ++k.ok : ++k.errors;
      k.response_bytes += c.response_bytes;
      if (ok) kind_latency[KindName(c.kind)].push_back(c.e2e_seconds);
      if (ok && c.ttft_seconds >= 0) kind_first[KindName(c.kind)].push_back(c.ttft_seconds);
      continue;
    }
    if (!ok) continue;
    ++r.ok;
    r.prompt_tokens += c.prompt_tokens;
    r.cached_tokens += c.cached_tokens;
    r.output_tokens += c.output_tokens;
    e2e.push_back(c.e2e_seconds);
    if (c.ttft_seconds >= 0) ttft.push_back(c.ttft_seconds);
    itl.insert(itl.end(), c.itl_seconds.begin(), c.itl_seconds.end());
  }
  r.ttft = Summarize(std::move(ttft));
  r.itl = Summarize(std::move(itl));
  r.e2e = Summarize(std::move(e2e));
  for (auto& [kind, stats] : r.interpret) {
    stats.latency = Summarize(kind_latency[kind]);
    stats.first_response = Summarize(kind_first[kind]);
  }
  if (r.elapsed_seconds > 0) {
    r.requests_per_second = static_cast<double>(ok_calls) / r.elapsed_seconds;
    r.output_tokens_per_second = static_cast<double>(r.output_tokens) / r.elapsed_seconds;
    r.total_tokens_per_second =
        static_cast<double>(r.output_tokens + r.prompt_tokens) / r.elapsed_seconds;
  }
  return r;
}

json BuildServerSection(const MetricSnapshot& before, const MetricSnapshot& after,
                        const GaugePeaks& peaks) {
  json s;
  json codes = json::object();
  const auto b = before.SumBy("kvlens_requests_total", "code", {{"rpc", "Generate"}});
  for (const auto& [code, v] :
       after.SumBy("kvlens_requests_total", "code", {{"rpc", "Generate"}})) {
    auto it = b.find(code);
    const double d = v - (it == b.end() ? 0 : it->second);
    if (d != 0) codes[code] = d;
  }
  s["generate_requests_by_code"] = codes;
  s["prompt_tokens"] = Delta(before, after, "kvlens_prompt_tokens_total");
  s["generated_tokens"] = Delta(before, after, "kvlens_generated_tokens_total");
  const double queries = Delta(before, after, "kvlens_prefix_cache_queries_total");
  const double hits = Delta(before, after, "kvlens_prefix_cache_hits_total");
  s["prefix_cache_queries"] = queries;
  s["prefix_cache_hits"] = hits;
  s["prefix_cache_hit_rate"] = queries > 0 ? json(hits / queries) : json(nullptr);
  s["preemptions"] = Delta(before, after, "kvlens_preemptions_total");
  s["engine_steps"] = Delta(before, after, "kvlens_batch_tokens_count");
  s["batch_tokens_mean"] = HistogramMean(before, after, "kvlens_batch_tokens");
  s["ttft_mean_seconds"] = HistogramMean(before, after, "kvlens_time_to_first_token_seconds");
  s["itl_mean_seconds"] = HistogramMean(before, after, "kvlens_inter_token_latency_seconds");
  s["queue_mean_seconds"] = HistogramMean(before, after, "kvlens_queue_duration_seconds");
  s["request_duration_mean_seconds"] =
      HistogramMean(before, after, "kvlens_request_duration_seconds");
  json interp = json::object();
  const auto ib = before.SumBy("kvlens_interp_requests_total", "kind");
  for (const auto& [kind, v] : after.SumBy("kvlens_interp_requests_total", "kind")) {
    auto it = ib.find(kind);
    const double d = v - (it == ib.end() ? 0 : it->second);
    if (d != 0) interp[kind] = d;
  }
  s["interp_requests_by_kind"] = interp;
  s["running_requests"] = after.Sum("kvlens_running_requests");
  s["waiting_requests"] = after.Sum("kvlens_waiting_requests");
  s["kv_cache_usage_ratio"] = after.Sum("kvlens_kv_cache_usage_ratio");
  json blocks = json::object();
  for (const auto& [state, v] : after.SumBy("kvlens_kv_cache_blocks", "state")) blocks[state] = v;
  s["kv_cache_blocks"] = blocks;
  s["peak_running_requests"] = peaks.running;
  s["peak_waiting_requests"] = peaks.waiting;
  s["peak_kv_cache_usage_ratio"] = peaks.kv_cache_usage;
  s["gauge_samples"] = peaks.samples;
  return s;
}

json ToJson(const Report& r) {
  json j;
  j["config"] = r.config;
  j["elapsed_seconds"] = r.elapsed_seconds;
  j["requests"] = {{"started", r.started},
                   {"ok", r.ok},
                   {"errors", r.errors},
                   {"dropped", r.dropped},
                   {"cancelled_at_drain", r.cancelled_at_drain}};
  j["errors_by_code"] = r.errors_by_code;
  if (!r.first_error.empty()) j["first_error"] = r.first_error;
  j["tokens"] = {
      {"prompt", r.prompt_tokens}, {"cached", r.cached_tokens}, {"output", r.output_tokens}};
  j["throughput"] = {{"requests_per_second", r.requests_per_second},
                     {"output_tokens_per_second", r.output_tokens_per_second},
                     {"total_tokens_per_second", r.total_tokens_per_second}};
  j["ttft_ms"] = SummaryJson(r.ttft, 1e3);
  j["itl_ms"] = SummaryJson(r.itl, 1e3);
  j["e2e_ms"] = SummaryJson(r.e2e, 1e3);
  json interp = json::object();
  for (const auto& [kind, k] : r.interpret) {
    interp[kind] = {{"ok", k.ok},
                    {"errors", k.errors},
                    {"latency_ms", SummaryJson(k.latency, 1e3)},
                    {"response_bytes", k.response_bytes}};
    // Streamed kinds only (AttentionMaps): time to the first chunk.
    if (k.first_response.count > 0) {
      interp[kind]["first_response_ms"] = SummaryJson(k.first_response, 1e3);
    }
  }
  j["interpret"] = interp;
  j["server"] = r.server_metrics ? r.server : json(nullptr);
  return j;
}

std::string FormatTable(const Report& r) {
  std::string out;
  int64_t interp_ok = 0;
  for (const auto& [kind, k] : r.interpret) interp_ok += k.ok;
  absl::StrAppendFormat(&out,
                        "kvlens-load: %d generate + %d interpretability ok, %d errors in "
                        "%.2f s (%d started",
                        r.ok, interp_ok, r.errors, r.elapsed_seconds, r.started);
  if (r.dropped > 0) absl::StrAppendFormat(&out, ", %d dropped over --max-in-flight", r.dropped);
  if (r.cancelled_at_drain > 0) {
    absl::StrAppendFormat(&out, ", %d cancelled at drain", r.cancelled_at_drain);
  }
  out += ")\n";
  absl::StrAppendFormat(&out,
                        "throughput: %.2f req/s, %.1f output tok/s, %.1f total tok/s "
                        "(%d prompt tokens, %d cached, %d output)\n",
                        r.requests_per_second, r.output_tokens_per_second,
                        r.total_tokens_per_second, r.prompt_tokens, r.cached_tokens,
                        r.output_tokens);
  absl::StrAppendFormat(&out, "%-22s %10s %10s %10s %10s %10s\n", "latency (ms)", "mean", "p50",
                        "p90", "p99", "samples");
  auto row = [&](const std::string& name, const Summary& s) {
    absl::StrAppendFormat(&out, "%-22s %10s %10s %10s %10s %10d\n", name, Ms(s, s.mean),
                          Ms(s, s.p50), Ms(s, s.p90), Ms(s, s.p99), s.count);
  };
  row("time to first token", r.ttft);
  row("inter-token latency", r.itl);
  row("end-to-end", r.e2e);
  for (const auto& [kind, k] : r.interpret) {
    row(absl::StrCat(kind, " (", k.errors, " err)"), k.latency);
  }
  for (const auto& [kind, k] : r.interpret) {
    absl::StrAppendFormat(&out, "%s: %d ok, %d errors, %.1f MiB received\n", kind, k.ok, k.errors,
                          static_cast<double>(k.response_bytes) / (1 << 20));
  }
  if (!r.errors_by_code.empty()) {
    out += "errors by code:";
    for (const auto& [code, n] : r.errors_by_code) absl::StrAppendFormat(&out, " %s=%d", code, n);
    out += "\n";
    if (!r.first_error.empty()) absl::StrAppendFormat(&out, "first error: %s\n", r.first_error);
  }
  if (!r.server_metrics) {
    out += "server metrics: not scraped\n";
    return out;
  }
  const json& s = r.server;
  absl::StrAppendFormat(
      &out,
      "server (delta over the run): %s generated tokens, %s engine steps, mean batch %s "
      "tokens, prefix-cache hit rate %s, %s preemptions\n",
      NumOrDash(s["generated_tokens"], "int"), NumOrDash(s["engine_steps"], "int"),
      NumOrDash(s["batch_tokens_mean"], "num"), NumOrDash(s["prefix_cache_hit_rate"], "pct"),
      NumOrDash(s["preemptions"], "int"));
  absl::StrAppendFormat(&out, "server means: ttft %s, itl %s, queue %s, request %s\n",
                        NumOrDash(s["ttft_mean_seconds"], "ms"),
                        NumOrDash(s["itl_mean_seconds"], "ms"),
                        NumOrDash(s["queue_mean_seconds"], "ms"),
                        NumOrDash(s["request_duration_mean_seconds"], "ms"));
  absl::StrAppendFormat(
      &out,
      "server gauges (after / peak): running %s / %s, waiting %s / %s, KV "
      "cache usage %s / %s\n",
      NumOrDash(s["running_requests"], "int"), NumOrDash(s["peak_running_requests"], "int"),
      NumOrDash(s["waiting_requests"], "int"), NumOrDash(s["peak_waiting_requests"], "int"),
      NumOrDash(s["kv_cache_usage_ratio"], "pct"),
      NumOrDash(s["peak_kv_cache_usage_ratio"], "pct"));
  return out;
}

}  // namespace kvlens::load
