// depthkit bench: median training-step time, tokens/s and peak memory, for one pathway kind or
// several interleaved (--kinds), or variants of the config interleaved (--variant); or the fused
// operators against their references (--ops).
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#include "depthkit/bench/decode_bench.h"
#include "depthkit/bench/op_bench.h"
#include "depthkit/bench/bench.h"
#include "depthkit/model/config_check.h"
#include "depthkit/util/error.h"
#include "depthkit/util/numbers.h"

namespace depthkit::cli {

namespace {

// A comma-separated list of option `option` (--kinds, --decode).
std::vector<std::string> split_list(const std::string& list, const std::string& option) {
  std::vector<std::string> kinds;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    if (end == start) fail(option, ": empty item in \"", list, "\"");
    kinds.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return kinds;
}

// --variant NAME[:section.key=value[,section.key=value…]]: the overrides split at the commas
// outside brackets and quotes, so that an array value stays whole (residual.kernels=[4,8]).
BenchVariant parse_variant(const std::string& spec) {
  const std::string where = cat("--variant \"", printable(spec), "\"");
  const size_t colon = spec.find(':');
  BenchVariant v{spec.substr(0, colon), {}};
  const bool name_ok = !v.name.empty() && std::all_of(v.name.begin(), v.name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.' || ch == '+';
  });
  if (!name_ok)
    fail(where, ": expected NAME[:section.key=value,...] with a NAME of letters, digits, '_', '-', '.' or '+'");
  if (colon == std::string::npos) return v;
  const std::string rest = spec.substr(colon + 1);
  int depth = 0;
  char quote = 0;
  std::string cur;
  for (size_t i = 0; i <= rest.size(); ++i) {
    const char ch = i < rest.size() ? rest[i] : ',';
    if (quote) {
      if (ch == quote) quote = 0;
    } else if (ch == '"' || ch == '\'') {
      quote = ch;
    } else if (ch == '[' || ch == '{') {
      ++depth;
    } else if ((ch == ']' || ch == '}') && depth > 0) {
      --depth;
    } else if (ch == ',' && depth == 0) {
      if (cur.empty()) fail(where, ": empty override (NAME:section.key=value,...)");
      v.overrides.push_back(cur);
      cur.clear();
      continue;
    }
    if (i < rest.size()) cur += ch;
  }
  return v;
}

nlohmann::json dispatch_json(const BenchResult& r) {
  if (!r.has_dispatch) return nullptr;
  const DispatchMemory& m = r.dispatch;
  return {{"expert_impl", m.expert_impl},
          {"peak_bytes_per_token", m.peak_per_token},
          {"kept_bytes_per_token", m.kept_per_token},
          {"fixed_bytes", m.fixed_bytes},
          {"tokens", m.tokens},
          {"sorted_copy_bytes_per_token", m.sorted_copy_per_token},
          {"analytic_peak_bytes_per_token", m.analytic_peak_per_token},
          {"analytic_kept_bytes_per_token", m.analytic_kept_per_token}};
}

// One MoE layer's dispatch memory per token, measured and counted (bench.h, DispatchMemory).
void print_dispatch(const std::vector<BenchResult>& results) {
  bool any = false;
  for (const auto& r : results) any |= r.has_dispatch;
  if (!any) return;
  const BenchResult& first = *std::find_if(results.begin(), results.end(), [](const auto& r) { return r.has_dispatch; });
  std::printf("\nMoE dispatch memory per token: one MoE layer's training forward, its routed part (sorted copies "
              "to combined output),\nmeasured at %lld and %lld tokens (the difference / %lld); analytic from moe.cpp's "
              "forward:\n",
              (long long)first.dispatch.tokens, 2 * (long long)first.dispatch.tokens, (long long)first.dispatch.tokens);
  std::printf("  %-14s %-8s %10s %10s %10s %10s %12s %10s\n", "variant", "experts", "peak B", "kept B", "analytic",
              "analytic", "sorted copy", "fixed");
  std::printf("  %-14s %-8s %10s %10s %10s %10s %12s %10s\n", "", "", "measured", "measured", "peak B", "kept B",
              "B (k·d·b)", "KiB");
  for (const auto& r : results) {
    if (!r.has_dispatch) continue;
    const DispatchMemory& m = r.dispatch;
    std::printf("  %-14s %-8s %10.1f %10.1f %10lld %10lld %12lld %10.1f\n", r.name.c_str(), m.expert_impl.c_str(),
                m.peak_per_token, m.kept_per_token, (long long)m.analytic_peak_per_token,
                (long long)m.analytic_kept_per_token, (long long)m.sorted_copy_per_token, double(m.fixed_bytes) / 1024);
  }
}

nlohmann::json profile_json(const BenchResult& r) {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto& row : r.profile)
    rows.push_back({{"op", row.name},
                    {"calls_per_step", double(row.calls) / double(r.profile_steps)},
                    {"total_ms_per_step", row.total_s * 1e3 / double(r.profile_steps)},
                    {"self_ms_per_step", row.self_s * 1e3 / double(r.profile_steps)}});
  return rows;
}

// The operators with the largest self time, per step.
void print_profile(const BenchResult& r, int64_t top) {
  double all = 0;
  for (const auto& row : r.profile) all += row.self_s;
  std::printf("\n%s: operators by self time, per step (%lld profiled steps, %.1f ms per step recorded)\n",
              r.name.c_str(), (long long)r.profile_steps, all * 1e3 / double(r.profile_steps));
  std::printf("  %10s %10s %8s  %s\n", "self ms", "total ms", "calls", "operator");
  for (size_t i = 0; i < r.profile.size() && int64_t(i) < top; ++i) {
    const auto& row = r.profile[i];
    const double n = double(r.profile_steps);
    std::printf("  %10.2f %10.2f %8.1f  %s\n", row.self_s * 1e3 / n, row.total_s * 1e3 / n, double(row.calls) / n,
                row.name.c_str());
  }
}

int print_ops(const std::string& shapes, int64_t repeats, bool json) {
  OpBenchReport r = bench_ops(shapes, repeats);
  if (json) {
    nlohmann::json j = {{"ops", nlohmann::json::array()}, {"bandwidth", nlohmann::json::array()}};
    for (const auto& o : r.ops)
      j["ops"].push_back({{"op", o.op}, {"shape", o.shape}, {"reference_ms", o.reference_ms}, {"fused_ms", o.fused_ms},
                          {"speedup", o.speedup()}, {"bytes", o.bytes}, {"gbs", o.gbs()},
                          {"fraction_of_copy", o.gbs() / o.copy_gbs}, {"irreducible_ms", o.irreducible_ms},
                          {"copy_bound_speedup", o.copy_bound_speedup()}, {"traffic_floor_ms", o.traffic_floor_ms()},
                          // null where the op's FLOPs are not counted (OpTiming::flops)
                          {"flops", o.flops > 0 ? nlohmann::json(o.flops) : nlohmann::json(nullptr)},
                          {"gemm_gflops", o.flops > 0 ? nlohmann::json(o.gemm_gflops) : nlohmann::json(nullptr)},
                          {"flop_floor_ms", o.flops > 0 ? nlohmann::json(o.flop_floor_ms()) : nlohmann::json(nullptr)},
                          {"of_flop_floor",
                           o.flops > 0 ? nlohmann::json(o.fused_ms / o.flop_floor_ms()) : nlohmann::json(nullptr)},
                          {"floor_ms", o.flops > 0 ? nlohmann::json(o.floor_ms()) : nlohmann::json(nullptr)},
                          {"of_floor", o.flops > 0 ? nlohmann::json(o.fused_ms / o.floor_ms()) : nlohmann::json(nullptr)}});
    for (const auto& b : r.bandwidth)
      j["bandwidth"].push_back({{"shape", b.shape}, {"bytes", b.bytes}, {"fused_ms", b.fused_ms}, {"gbs", b.gbs()},
                                {"copy_gbs", b.copy_gbs}, {"fraction_of_copy", b.gbs() / b.copy_gbs}});
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("forward + backward, medians of %lld; fused GB/s: the least bytes the fused op must move ÷ its time;\n"
              "copy bound: the speedup of an op that moved those bytes at the speed of a plain copy (same run),\n"
              "after the work both must do (mhc_pre: its three GEMMs, timed alone)\n\n",
              (long long)repeats);
  std::printf("%-20s %-28s %12s %9s %8s %9s %8s %10s\n", "op", "shape", "reference ms", "fused ms", "speedup",
              "fused GB/s", "of copy", "copy bound");
  for (const auto& o : r.ops)
    std::printf("%-20s %-28s %12.3f %9.3f %7.2fx %9.2f %7.0f%% %9.2fx\n", o.op.c_str(), o.shape.c_str(), o.reference_ms,
                o.fused_ms, o.speedup(), o.gbs(), 100.0 * o.gbs() / o.copy_gbs, o.copy_bound_speedup());
  std::printf("\nagainst their FLOP floor: the fused forward + backward's FLOPs as its kernels run them (a backward's\n"
              "recomputation counted, multiply-add = 2) at the rate of a GEMM at the shape ([P, d] · [d, d], same run);\n"
              "traffic: its bytes at copy speed; floor: the two added\n");
  std::printf("%-20s %-28s %9s %12s %13s %10s %9s %9s %12s %8s\n", "op", "shape", "GFLOP", "GEMM GFLOP/s",
              "FLOP floor ms", "traffic ms", "floor ms", "fused ms", "x FLOP floor", "x floor");
  for (const auto& o : r.ops)
    if (o.flops > 0)
      std::printf("%-20s %-28s %9.3f %12.1f %13.3f %10.3f %9.3f %9.3f %11.2fx %7.2fx\n", o.op.c_str(), o.shape.c_str(),
                  o.flops / 1e9, o.gemm_gflops, o.flop_floor_ms(), o.traffic_floor_ms(), o.floor_ms(), o.fused_ms,
                  o.fused_ms / o.flop_floor_ms(), o.fused_ms / o.floor_ms());
  std::printf("\nfused depth_read forward bandwidth against a plain copy in the same run:\n");
  for (const auto& b : r.bandwidth)
    std::printf("%-28s %8.3f ms  %6.2f GB/s  copy %6.2f GB/s  %5.1f%% of copy\n", b.shape.c_str(), b.fused_ms, b.gbs(),
                b.copy_gbs, 100.0 * b.gbs() / b.copy_gbs);
  return 0;
}

int print_decoding(const Config& cfg, const std::vector<std::string>& kinds, const std::string& list, int64_t steps,
                   bool json) {
  std::vector<int64_t> lengths;
  for (const std::string& item : split_list(list, "--decode"))
    lengths.push_back(parse_int(item, 2, kMaxSeqLen, "--decode"));  // a context length
  // Each length needs a prefill before its timed positions; the full forwards are slow, so fewer.
  const int64_t cached_steps = std::min(steps, *std::min_element(lengths.begin(), lengths.end()) - 1);
  const int64_t recompute_steps = std::min<int64_t>(cached_steps, 10);
  const auto rows = bench_decoding(cfg, kinds, lengths, cached_steps, recompute_steps);
  if (json) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& r : rows)
      j.push_back({{"kind", r.kind}, {"length", r.length}, {"cached_ms", r.cached_ms},
                   {"cached_tokens_per_s", r.cached_tokens_per_s()}, {"recompute_ms", r.recompute_ms},
                   {"recompute_tokens_per_s", r.recompute_tokens_per_s()}, {"speedup", r.recompute_ms / r.cached_ms},
                   {"cache_bytes", r.cache_bytes}});
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }
  std::printf("one sequence, the next position at context length T: with the caches (median of %lld positions)\n"
              "against the full forward of the T-position prefix (median of %lld)\n\n",
              (long long)cached_steps, (long long)recompute_steps);
  std::printf("%-14s %6s %10s %10s %13s %13s %8s %12s\n", "kind", "T", "cached ms", "tokens/s", "recompute ms",
              "tokens/s", "speedup", "cache bytes");
  for (const auto& r : rows)
    std::printf("%-14s %6lld %10.3f %10.1f %13.3f %13.1f %7.1fx %12lld\n", r.kind.c_str(), (long long)r.length, r.cached_ms,
                r.cached_tokens_per_s(), r.recompute_ms, r.recompute_tokens_per_s(), r.recompute_ms / r.cached_ms,
                (long long)r.cache_bytes);
  return 0;
}

// The bench command's arguments (add_bench).
struct BenchArgs : ConfigArgs {
  std::string kinds, ops, decode;
  std::vector<std::string> variants;
  int64_t steps = 20, warmup = 3, profile = 0, top = 25;
};

// The --variant options, parsed, each name given once.
std::vector<BenchVariant> parse_variants(const std::vector<std::string>& specs) {
  std::vector<BenchVariant> variants;
  for (const auto& spec : specs) {
    variants.push_back(parse_variant(spec));
    for (size_t j = 0; j + 1 < variants.size(); ++j)
      if (variants[j].name == variants.back().name) fail("--variant: the name '", variants.back().name, "' is given twice");
  }
  return variants;
}

// The least a kind's step can take over the first kind's: its pathway's FLOPs beyond the first's
// at a GEMM's rate, plus its bytes beyond the first's at a copy's speed (no overlap assumed
// between the two: the pathways' operators alternate passes bound by either).
double floor_ms(const BenchResult& r, const BenchResult& first) {
  return (r.flop_ms() - first.flop_ms()) + (r.traffic_ms() - first.traffic_ms());
}

// Every run's figures as JSON: one object for a single run, {"runs": [...]} for several.
void print_runs_json(const std::vector<BenchResult>& results, bool several, bool profile) {
  const double base = results[0].median_step_s;
  nlohmann::json runs = nlohmann::json::array();
  for (const auto& r : results)
    runs.push_back({{"kind", r.kind},
                    {"variant", r.name},
                    {"overrides", r.overrides},
                    {"median_step_s", r.median_step_s},
                    {"tokens_per_s", r.tokens_per_s},
                    {"tokens_per_step", r.tokens_per_step},
                    {"overhead", r.median_step_s / base - 1.0},
                    {"overhead_ms", (r.median_step_s - base) * 1e3},
                    {"ratio", r.median_step_s / base},
                    // the pathway's bytes per step (`depthkit cost`, forward and backward)
                    // at the copy's speed; the bound is what the first kind's leaves over
                    {"traffic_bytes_per_step", r.traffic_bytes},
                    {"copy_gbs", r.copy_gbs},
                    {"traffic_ms", r.traffic_ms()},
                    {"traffic_bound_ms", r.traffic_ms() - results[0].traffic_ms()},
                    // the pathway's FLOPs per step (`depthkit cost`) at a GEMM's rate; the bound
                    // is what the first kind's leaves over, and the floor both bounds together
                    {"pathway_flops_per_step", r.pathway_flops},
                    {"gemm_gflops", r.gemm_gflops},
                    {"flop_ms", r.flop_ms()},
                    {"flop_bound_ms", r.flop_ms() - results[0].flop_ms()},
                    {"floor_ms", floor_ms(r, results[0])},
                    {"floor", floor_ms(r, results[0]) / (base * 1e3)},
                    {"peak_rss_bytes", r.peak_rss_bytes},
                    {"peak_tensor_bytes", r.peak_tensor_bytes},
                    {"device", r.device},
                    // null: not counted (the CPU, whose tensors peak_tensor_bytes counts)
                    {"peak_device_bytes",
                     r.peak_device_bytes >= 0 ? nlohmann::json(r.peak_device_bytes) : nlohmann::json(nullptr)},
                    {"parameters", r.parameters},
                    {"active_parameters", r.active_parameters},
                    // null: a dense model (or a device whose memory is not counted)
                    {"dispatch", dispatch_json(r)},
                    {"step_s", r.step_s}});
  if (profile)
    for (size_t k = 0; k < results.size(); ++k) runs[k]["profile"] = profile_json(results[k]);
  std::printf("%s\n", (several ? nlohmann::json{{"runs", runs}} : runs[0]).dump().c_str());
}

// Whether the runs' device memory is counted (on a GPU): then a table's memory column is the
// device's, as the CPU's tensors are only the batches.
bool device_memory(const std::vector<BenchResult>& results) { return results[0].peak_device_bytes >= 0; }

// A run's figure in a table's memory column, in MiB.
double table_memory_mib(const BenchResult& r, bool device_memory) {
  return double(device_memory ? r.peak_device_bytes : r.peak_tensor_bytes) / (1 << 20);
}

// One run (no --kinds, no --variant): a line.
void print_single(const BenchResult& r, const BenchArgs& a) {
  const std::string device_peak = r.peak_device_bytes >= 0
                                      ? cat(", peak ", r.device, " memory ", double(r.peak_device_bytes) / (1 << 20), " MiB")
                                      : "";
  std::printf("%s: median step %.2f ms, %.0f tokens/s, peak tensor memory %.1f MiB%s, peak RSS %.1f MiB "
              "(%lld steps after %lld warm-up, on %s)\n",
              r.kind.c_str(), r.median_step_s * 1e3, r.tokens_per_s, double(r.peak_tensor_bytes) / (1 << 20),
              device_peak.c_str(), double(r.peak_rss_bytes) / (1 << 20), (long long)a.steps, (long long)a.warmup,
              r.device.c_str());
}

// --variant: a row per variant, ratios against the first, then each variant's overrides.
void print_variants(const std::vector<BenchResult>& results, const BenchArgs& a) {
  const double base = results[0].median_step_s;
  std::printf("%-14s %10s %10s %9s %11s %12s   (interleaved, medians of %lld steps after %lld warm-up; on %s)\n",
              "variant", "step ms", "tokens/s", "vs first", device_memory(results) ? "device MiB" : "tensor MiB",
              "active par.", (long long)a.steps, (long long)a.warmup, results[0].device.c_str());
  for (const auto& r : results)
    std::printf("%-14s %10.2f %10.0f %8.3fx %11.1f %12lld\n", r.name.c_str(), r.median_step_s * 1e3, r.tokens_per_s,
                r.median_step_s / base, table_memory_mib(r, device_memory(results)), (long long)r.active_parameters);
  for (const auto& r : results) {
    std::string sets;
    for (const auto& o : r.overrides) sets += (sets.empty() ? "" : ", ") + o;
    std::printf("  %s: %s\n", r.name.c_str(), sets.empty() ? "the config as it is" : sets.c_str());
  }
}

// --kinds: a row per kind, overheads against the first, and beside the overhead its floor: the
// FLOP bound (the pathway's FLOPs beyond the first kind's at a GEMM's rate) plus the traffic bound
// (its bytes beyond the first kind's at a copy's speed), the least its overhead can be (with
// residual first, its row is 0: the standard residual's own adds are the baseline, as `depthkit
// cost`'s overhead subtracts them).
void print_kinds(const std::vector<BenchResult>& results, const Config& cfg, const BenchArgs& a) {
  const double base = results[0].median_step_s;
  std::printf("%-14s %12s %12s %10s %12s %8s %14s %17s %12s   (interleaved, medians of %lld steps after %lld "
              "warm-up; S = %lld; on %s)\n",
              "kind", "step ms", "tokens/s", "overhead", "overhead ms", "floor", "FLOP bound ms", "traffic bound ms",
              device_memory(results) ? "device MiB" : "tensor MiB", (long long)a.steps, (long long)a.warmup,
              (long long)cfg.residual.block_sublayers, results[0].device.c_str());
  for (const auto& r : results)
    std::printf("%-14s %12.2f %12.0f %9.1f%% %12.2f %7.1f%% %14.2f %17.2f %12.1f\n", r.kind.c_str(),
                r.median_step_s * 1e3, r.tokens_per_s, 100.0 * (r.median_step_s / base - 1.0),
                (r.median_step_s - base) * 1e3, 100.0 * floor_ms(r, results[0]) / (base * 1e3),
                r.flop_ms() - results[0].flop_ms(), r.traffic_ms() - results[0].traffic_ms(),
                table_memory_mib(r, device_memory(results)));
  std::printf("floor: FLOP bound + traffic bound, of %s's step;\n", results[0].kind.c_str());
  std::printf("FLOP bound ms: (the kind's pathway FLOPs per step - %s's) / a GEMM's %.1f GFLOP/s ([tokens, d] . [d, d], "
              "timed among the steps);\nFLOPs per step (`depthkit cost`'s, 3x the forward):",
              results[0].kind.c_str(), results[0].gemm_gflops);
  for (size_t k = 0; k < results.size(); ++k)
    std::printf("%s %s %.3f GFLOP", k ? "," : "", results[k].kind.c_str(), results[k].pathway_flops / 1e9);
  std::printf("\ntraffic bound ms: (the kind's pathway bytes per step - %s's) / a plain copy's %.2f GB/s, timed "
              "among the steps;\nbytes per step (`depthkit cost`'s traffic, forward and backward):",
              results[0].kind.c_str(), results[0].copy_gbs);
  for (size_t k = 0; k < results.size(); ++k)
    std::printf("%s %s %.1f MB", k ? "," : "", results[k].kind.c_str(), results[k].traffic_bytes / 1e6);
  std::printf("\n");
}

// Runs the mode the options choose (--ops, --decode, --variant, --kinds, or the config alone)
// and prints its report.
int run_bench_command(const BenchArgs& a) {
  if (!a.ops.empty()) return print_ops(a.ops, a.steps, a.json);
  if (a.config.empty()) fail("bench: --config is required (or --ops to time the operators)");
  Config cfg = load_config(a.config, a.sets);
  if (!a.decode.empty())
    return print_decoding(cfg, a.kinds.empty() ? std::vector<std::string>{cfg.residual.kind} : split_list(a.kinds, "--kinds"),
                          a.decode, a.steps, a.json);
  const std::vector<BenchVariant> variants = parse_variants(a.variants);
  const bool several = !a.kinds.empty() || !variants.empty();
  const std::vector<BenchResult> results =
      !variants.empty()  ? run_bench_variants(cfg, variants, a.steps, a.warmup, a.profile)
      : a.kinds.empty() ? std::vector<BenchResult>{run_bench(cfg, a.steps, a.warmup, a.profile)}
                        : run_bench_kinds(cfg, split_list(a.kinds, "--kinds"), a.steps, a.warmup, a.profile);
  if (a.json) {
    print_runs_json(results, several, a.profile > 0);
    return 0;
  }
  if (!several) print_single(results[0], a);
  else if (!variants.empty()) print_variants(results, a);
  else print_kinds(results, cfg, a);
  print_dispatch(results);
  if (a.profile > 0)
    for (const auto& r : results) print_profile(r, a.top);
  return 0;
}

}  // namespace

void add_bench(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("bench", "time training steps on random tokens (on train.device), or the fused "
                                          "operators (--ops)");
  auto a = std::make_shared<BenchArgs>();
  add_config_options(cmd, *a, ConfigFile::optional);
  cmd->add_option("--kinds", a->kinds,
                  "comma-separated residual kinds to time interleaved, overheads against the first "
                  "(e.g. residual,attnres,dar,msar,mhc)");
  auto* variant_option =
      cmd->add_option("--variant", a->variants,
                      "NAME[:section.key=value,...]: a variant of the config to time interleaved with the others "
                      "(repeatable), ratios against the first")
          ->expected(1)
          ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--ops", a->ops, "time each fused operator against its reference: tiny, 0.1b or all");
  cmd->add_option("--decode", a->decode,
                  "decoding speed at these context lengths (e.g. 256,1024): the next position with the caches against "
                  "the full forward, per kind (--kinds; default the config's)");
  add_number(cmd, "--steps", a->steps, 1, int64_t(1) << 20, "timed steps (repeats with --ops)");
  add_number(cmd, "--warmup", a->warmup, 0, int64_t(1) << 20, "untimed warm-up steps");
  add_number(cmd, "--profile", a->profile, 0, int64_t(1) << 20,
             "then run this many more steps per kind under the operator profiler and print where the time goes");
  add_number(cmd, "--top", a->top, 1, int64_t(1) << 20, "operators to print per kind with --profile");
  cmd->add_flag("--json", a->json, "print JSON");
  variant_option->excludes("--kinds");
  variant_option->excludes("--decode");
  cmd->callback([&action, a] { action = [a] { return run_bench_command(*a); }; });
}

}  // namespace depthkit::cli
