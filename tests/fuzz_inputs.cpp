// Hostile inputs by the thousand. Configs, --set values, token shards, meta.json, checkpoints
// (safetensors headers and offsets), state.json, `latest` and token files are mutated by a seeded
// generator; every option of every command (walked from the program's own option table) is given
// values wrong for its kind; torchrun's launch variables are given wrong values; and files and
// directories are given in places where they must not be taken (an input as an output, a FIFO in a
// corpus, a file as a run directory). Each case runs a depthkit command in a forked child, through
// the same cli::run as the program. Every case must end in one of two ways:
//   - success: the mutation left a valid input (a weight byte flipped, a key set to a legal value);
//   - a clean failure: exit code 1 or 2, exactly one line on stderr, "depthkit: error: ...", that
//     names the file or key at fault, and nothing written or removed in the run directory.
// Never a signal (abort, SIGSEGV, SIGBUS), never a hang. Each child's address space is capped 1 GiB
// above what it maps at the start, so a size the checks let through fails in the allocator and
// must be reported in one line too.
//   DEPTHKIT_FUZZ_SCALE  multiplies every class's case count (default 1, about a minute on 2 cores;
//                        20 for a long run)
//   DEPTHKIT_FUZZ_SEED   the generator's seed (default 1)
//   DEPTHKIT_FUZZ_LOG    a file to which every refusal's line is appended
// The counts of accepted and refused cases per class are printed at the end.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>

#include "depthkit/cli/app.h"
#include "depthkit/cli/commands.h"
#include "depthkit/util/fs.h"
#include "depthkit/util/numbers.h"
#include "depthkit/util/progress.h"
#include "helpers.h"

namespace depthkit::test {
namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

int64_t scaled(int64_t n) { return std::max<int64_t>(1, n * env_int("DEPTHKIT_FUZZ_SCALE", 1)); }

struct Outcome {
  int rc = -1;      // exit code, when it exited
  int signal = 0;   // the signal that ended it, if one did
  std::string err;  // everything it wrote to stderr
};

// Environment variables for a case: each set to its value, or unset when the value is nullopt.
using Env = std::vector<std::pair<std::string, std::optional<std::string>>>;

// Runs `depthkit args...` in a forked child; its stdout is discarded, its stderr captured.
Outcome run_cli(const std::vector<std::string>& args, const fs::path& scratch, const Env& env = {}) {
  const std::string err_path = (scratch / "stderr.txt").string();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (::chdir(scratch.c_str()) != 0) ::_exit(99);  // relative paths a case names land in its scratch
    const int nul = ::open("/dev/null", O_WRONLY);
    ::dup2(err, 2);
    ::dup2(nul, 1);
    ::alarm(120);  // a hang ends in SIGALRM, which the parent reports
    long pages = 0;
    if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const rlim_t cap = rlim_t(pages) * rlim_t(::sysconf(_SC_PAGESIZE)) + (rlim_t(1) << 30);
    const rlimit limit{cap, cap};
    ::setrlimit(RLIMIT_AS, &limit);
    Progress::set_enabled(false);
    for (const auto& [name, value] : env) {
      if (value) ::setenv(name.c_str(), value->c_str(), 1);
      else ::unsetenv(name.c_str());
    }
    std::vector<std::string> full = {"depthkit"};
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = cli::run(int(full.size()), argv.data());
    std::fflush(nullptr);
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  Outcome o;
  if (WIFEXITED(status)) o.rc = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) o.signal = WTERMSIG(status);
  std::ifstream in(err_path, std::ios::binary);
  o.err.assign(std::istreambuf_iterator<char>(in), {});
  return o;
}

// Every file under `dir` with its bytes (folders as a marker), to prove nothing changed.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    if (e.is_directory()) out[rel] = "<dir>";
    else if (e.is_regular_file()) out[rel] = read_file(e.path());
    else out[rel] = "<other>";
  }
  return out;
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << s;
}

// The tally of one input class, printed at the end; failures stop being reported after ten.
struct Tally {
  std::string name;
  int64_t accepted = 0, refused = 0, bad = 0;
  ~Tally() {
    std::printf("fuzz %-10s %6lld cases: %6lld accepted, %6lld refused with one line, %lld wrong\n", name.c_str(),
                (long long)(accepted + refused + bad), (long long)accepted, (long long)refused, (long long)bad);
  }
  // Checks one outcome. `names`: the message must contain one of them.
  bool check(const Outcome& o, const std::vector<std::string>& names, const std::string& what) {
    std::string why;
    if (o.signal) why = cat("killed by signal ", o.signal);
    else if (o.rc == 0) {
      ++accepted;
      return true;
    } else if (o.rc != 1 && o.rc != 2) why = cat("exit code ", o.rc);
    else if (std::count(o.err.begin(), o.err.end(), '\n') != 1 || o.err.back() != '\n') why = "not exactly one stderr line";
    else if (!o.err.starts_with("depthkit: error: ")) why = "the line is not a depthkit error";
    else if (std::none_of(names.begin(), names.end(), [&](const std::string& n) { return o.err.find(n) != std::string::npos; }))
      why = "the message names neither " + names.front() + (names.size() > 1 ? " nor " + names.back() : "");
    if (why.empty()) {
      ++refused;
      if (const char* log = std::getenv("DEPTHKIT_FUZZ_LOG"); log && *log) std::ofstream(log, std::ios::app) << name << ": " << o.err;
      return true;
    }
    if (++bad <= 10) ADD_FAILURE() << name << ": " << what << ": " << why << "; stderr: " << o.err;
    return false;
  }
};

class Fuzz : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ::setenv("DEPTHKIT_PROGRAM", DEPTHKIT_PROGRAM_PATH, 1);  // what compare and --nproc run again
    base_ = new TempDir();
    const fs::path b = base_->path;
    write_pattern_data((b / "data").string(), 64, 4000, 1200);
    write_text(b / "data" / "meta.json", "{\"vocab_size\": 64, \"unigram_entropy_nats\": 4.0, \"eos_id\": 1}\n");
    config_text_ =
        "[model]\nn_layers = 1\nd_model = 32\nn_heads = 4\nn_kv_heads = 2\nd_ff = 64\nvocab_size = 64\n"
        "seq_len = 16\n[residual]\nkind = \"dar\"\nblock_sublayers = 2\n[data]\ndir = \"" + (b / "data").string() + "\"\n"
        "[train]\nmicro_batch = 2\nsteps = 2\neval_every = 0\neval_tokens = 64\ncheckpoint_every = 1\n"
        "keep_checkpoints = 2\nlog_every = 1\nthreads = 1\n[optim]\nlr = 3e-3\nmin_lr = 3e-4\nwarmup_steps = 1\n";
    write_text(b / "base.toml", config_text_);
    Outcome o = run_cli({"train", "--config", (b / "base.toml").string(), "--run-dir", (b / "run").string()}, b);
    ASSERT_EQ(o.rc, 0) << o.err;
    o = run_cli({"init", "--config", (b / "base.toml").string(), "--out", (b / "ck").string()}, b);
    ASSERT_EQ(o.rc, 0) << o.err;
    // A valid .npy [2, 8] of little-endian int32 ids, and the same ids as text.
    std::string header = "{'descr': '<i4', 'fortran_order': False, 'shape': (2, 8), }";
    header.resize(118, ' ');
    header += '\n';
    npy_ = std::string("\x93NUMPY\x01\x00", 8) + char(header.size() & 0xff) + char(header.size() >> 8) + header;
    for (int32_t i = 0; i < 16; ++i) npy_.append(reinterpret_cast<const char*>(&i), 4);
    tokens_text_ = "0 1 2 3 4 5 6 7\n8 9 10 11 12 13 14 15\n";
  }
  static void TearDownTestSuite() { delete base_; }

  void SetUp() override {
    rng_.seed(uint64_t(env_int("DEPTHKIT_FUZZ_SEED", 1)) * 1000003 + std::hash<std::string>()(
        ::testing::UnitTest::GetInstance()->current_test_info()->name()));
    scratch_ = base_->path / "scratch";
    fs::remove_all(scratch_);
    fs::create_directories(scratch_);
  }

  uint64_t pick(uint64_t n) { return rng_() % n; }
  template <class T>
  const T& one_of(const std::vector<T>& v) { return v[pick(v.size())]; }

  // A byte-level mutation: flip, insert, delete, truncate, duplicate, or swap a digit.
  std::string mutate_bytes(std::string s) {
    if (s.empty()) return std::string(1 + pick(8), char(pick(256)));
    const size_t at = pick(s.size());
    switch (pick(7)) {
      case 0: s[at] = char(pick(256)); break;
      case 1: s.insert(at, std::string(1 + pick(16), char(pick(256)))); break;
      case 2: s.erase(at, 1 + pick(32)); break;
      case 3: s.resize(at); break;
      case 4: s.insert(at, s.substr(at, 1 + pick(64))); break;
      case 5: {
        const size_t d = s.find_first_of("0123456789", at);
        if (d != std::string::npos) s[d] = char('0' + pick(10));
        else s[at] = char(pick(256));
        break;
      }
      default: s.insert(at, one_of<std::string>({"9999999999999999999999", "-1", "\n", std::string(1, '\0'), "\r\n", "1e999", "nan"}));
    }
    return s;
  }

  // Values no key should take silently: out of range, non-finite, overflowing, of another type.
  std::string hostile_value() {
    return one_of<std::string>({"0", "-1", "-9223372036854775808", "9223372036854775807", "4611686018427387904",
                                "18446744073709551616", "1e308", "inf", "-inf", "nan", "1.5", "\"\"", "\"x\"",
                                "[1, 2]", "[]", "true", "{ a = 1 }", "1073741824", "16777216", "1048576",
                                "2147483647", "\"cuda\"", "1e-300", "3\nmodel.n_layers = 2", "2\r\n[model]"});
  }

  // A value for `key` just past what it accepts (one below its least, one above its greatest, a
  // name it does not have), or one of the values no key should take.
  std::string hostile_value(const ConfigKey& key) {
    if (pick(2)) return hostile_value();
    const bool integral = key.type == "integer" || key.type == "integer array";
    auto number = [&](double v) { return integral ? std::to_string(int64_t(v)) : number_text(v); };
    auto wrap = [&](const std::string& v) { return key.type == "integer array" ? "[" + v + "]" : v; };
    if (integral || key.type == "number") {
      const bool low = std::isfinite(key.min) && (!std::isfinite(key.max) || pick(2));
      if (low) return wrap(number(integral ? key.min - 1 : std::nextafter(key.min, -INFINITY) - std::abs(key.min) * 1e-9));
      if (std::isfinite(key.max)) return wrap(number(integral ? key.max + 1 : key.max * (1 + 1e-9) + 1e-12));
    }
    if (key.type == "string") return "\"" + (key.choices.empty() ? std::string("no_such_name") : key.choices[0] + "x") + "\"";
    return hostile_value();
  }

  // A JSON value of the wrong kind or range for a counter or a string.
  nlohmann::json hostile_json() {
    switch (pick(14)) {
      case 0: return -1;
      case 1: return INT64_MIN;
      case 2: return INT64_MAX;
      case 3: return UINT64_MAX;
      case 4: return 1.5;
      case 5: return 1e300;
      case 6: return "7";
      case 7: return nullptr;
      case 8: return nlohmann::json::array();
      case 9: return nlohmann::json::object();
      case 10: return true;
      case 11: return 0;
      case 12: return std::string(1 + pick(9000), 'a');
      default: return int64_t(pick(1000000));
    }
  }

  // A mutation of a safetensors file: its header length, its JSON entries, or its bytes.
  std::string mutate_safetensors(const std::string& file) {
    uint64_t len = 0;
    for (int i = 0; i < 8; ++i) len |= uint64_t(uint8_t(file[i])) << (8 * i);
    auto with_length = [&](uint64_t n, const std::string& rest) {
      std::string out(8, '\0');
      for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
      return out + rest;
    };
    const uint64_t kind = pick(10);
    if (kind == 0) {  // the header length off by a little or a lot
      const int64_t delta = one_of<int64_t>({-8, -2, -1, 1, 2, 8, 1 << 20, int64_t(1) << 40, -int64_t(len)});
      return with_length(len + uint64_t(delta), file.substr(8));
    }
    if (kind == 1) return mutate_bytes(file);
    if (kind == 2) return file.substr(0, pick(file.size()));
    if (kind == 3) {  // a byte flipped inside the header
      std::string out = file;
      out[8 + pick(len)] = char(pick(256));
      return out;
    }
    nlohmann::json h = nlohmann::json::parse(file.substr(8, len));
    std::vector<std::string> names;
    for (auto& [k, v] : h.items())
      if (k != "__metadata__") names.push_back(k);
    auto& e = h[one_of(names)];
    switch (kind) {
      case 4: {  // a shape dimension
        auto& shape = e["shape"];
        nlohmann::json v = one_of<nlohmann::json>({-1, 0, INT64_MAX, UINT64_MAX, 4611686018427387904LL, 1.0, "2",
                                                   1 << 30, nullptr});
        if (shape.empty() || pick(3) == 0) shape.push_back(v);
        else shape[pick(shape.size())] = v;
        break;
      }
      case 5: {  // the offsets: shifted, overlapping another tensor, reversed or huge
        auto& o = e["data_offsets"];
        const auto& other = h[one_of(names)]["data_offsets"];
        switch (pick(5)) {
          case 0: o = other; break;
          case 1: o[0] = o[0].get<uint64_t>() + 4; o[1] = o[1].get<uint64_t>() + 4; break;
          case 2: o = {o[1], o[0]}; break;
          case 3: o[1] = UINT64_MAX; break;
          default: o = {0, -4}; break;
        }
        break;
      }
      case 6: e["dtype"] = one_of<nlohmann::json>({"F16", "I64", "U8", "BOOL", "F8", "", 3, nullptr}); break;
      case 7: e.erase(one_of<std::string>({"dtype", "shape", "data_offsets"})); break;
      case 8: h[one_of<std::string>({"__metadata__", "extra"})] = hostile_json(); break;
      default: h.erase(one_of(names)); break;
    }
    std::string json = h.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (pick(2)) json.resize((json.size() + 7) / 8 * 8, ' ');
    return with_length(json.size(), json + file.substr(8 + len));
  }

  static TempDir* base_;
  static std::string config_text_, npy_, tokens_text_;
  fs::path scratch_;
  std::mt19937_64 rng_;
};

TempDir* Fuzz::base_ = nullptr;
std::string Fuzz::config_text_, Fuzz::npy_, Fuzz::tokens_text_;

TEST_F(Fuzz, Configs) {
  Tally tally{"config"};
  const fs::path config = scratch_ / "config.toml", out = scratch_ / "ck";
  // The first 2n cases give every one of the n declared keys (Config::keys, so that none is missed
  // and a new key is fuzzed without a line here) a hostile value, first with --set and then in the
  // file; the rest are drawn at random.
  const std::vector<ConfigKey> keys = Config::keys();
  const int64_t n = int64_t(keys.size());
  for (int64_t i = 0; i < std::max(scaled(480), 2 * n); ++i) {
    std::vector<std::string> args = {"init", "--config", config.string(), "--out", out.string()};
    // An allocation the checks let through names what it was building instead of a key.
    std::vector<std::string> names = {config.string(), "out of memory while building", "building the model:"};
    std::string text = config_text_;
    const ConfigKey& declared = i < 2 * n ? keys[size_t(i % n)] : one_of(keys);
    const std::string key = declared.path(), value = hostile_value(declared);
    switch (i < 2 * n ? int(i / n) : pick(10) < 9 ? pick(3) : 3) {
      case 3: {  // sizes past the machine: refused up front, or failing in the capped allocator
        const std::string size_key = one_of<std::string>({"model.vocab_size", "model.d_model", "model.d_ff", "model.seq_len"});
        args.insert(args.end(), {"--set", cat(size_key, "=", int64_t(1) << (20 + pick(11)))});
        names = {"--set", size_key, config.string(), "out of memory while building", "building the model:"};
        break;
      }
      case 0:  // a key given a hostile value with --set
        args.insert(args.end(), {"--set", key + "=" + value});
        // A combination of keys that cannot run is named by the file where the others come from.
        names = {"--set", key, config.string(), "out of memory while building", "building the model:"};
        break;
      case 1: {  // a key given a hostile value in the file, in its section (added when missing)
        const std::string& section = declared.section;
        const std::string& name = declared.key;
        const size_t at = text.find("[" + section + "]\n");
        if (at == std::string::npos) {
          text += "[" + section + "]\n" + name + " = " + value + "\n";
          break;
        }
        const size_t end = std::min(text.size(), text.find("\n[", at + 1));  // the section's lines
        const size_t line = text.find("\n" + name + " = ", at);
        if (line < end) text.replace(line + 1, text.find('\n', line + 1) - line - 1, name + " = " + value);
        else text.insert(at + section.size() + 3, name + " = " + value + "\n");
        break;
      }
      default: text = mutate_bytes(mutate_bytes(text));
    }
    write_text(config, text);
    const Outcome o = run_cli(args, scratch_);
    tally.check(o, names, "config " + (args.size() > 5 ? args.back() : text));
    fs::remove_all(out);
  }
}

TEST_F(Fuzz, TokenShardsAndMeta) {
  Tally shards{"shard"}, meta{"meta.json"};
  const fs::path data = scratch_ / "data", run = scratch_ / "run";
  for (int64_t i = 0; i < scaled(240); ++i) {
    fs::remove_all(data);
    fs::copy(base_->path / "data", data, fs::copy_options::recursive);
    const bool on_meta = pick(3) == 0;
    std::string target = on_meta ? "meta.json" : one_of<std::string>({"train_000000.bin", "val_000000.bin"});
    std::string bytes = read_file(data / target);
    if (on_meta) {
      nlohmann::json m = nlohmann::json::parse(bytes);
      if (pick(3)) m["vocab_size"] = hostile_json();
      else m = nlohmann::json::parse(mutate_bytes(bytes), nullptr, false);
      bytes = m.is_discarded() ? mutate_bytes(bytes) : m.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    } else {
      switch (pick(4)) {
        case 0: {  // a header field: magic, version or token count
          const int32_t v = one_of<int32_t>({0, -1, INT32_MAX, INT32_MIN, 20240520, 20240801, 1, 7, 3999, 4001, 100000});
          std::memcpy(bytes.data() + 4 * pick(3), &v, 4);
          break;
        }
        case 1: bytes.resize(pick(bytes.size())); break;
        case 2: bytes += std::string(1 + pick(9), '\1'); break;
        default:  // ids past the vocabulary in the body
          for (int k = 0; k < 64; ++k) bytes[1024 + pick(bytes.size() - 1024)] = char(0x7f);
      }
    }
    if (pick(20) == 0) {  // a folder where the file should be
      fs::remove(data / target);
      fs::create_directories(data / target / "x");
    } else {
      write_text(data / target, bytes);
    }
    const Outcome o = run_cli({"train", "--config", (base_->path / "base.toml").string(), "--set",
                               "data.dir=" + data.string(), "--set", "train.steps=1", "--run-dir", run.string()},
                              scratch_);
    if ((on_meta ? meta : shards).check(o, {data.string()}, target) && o.rc != 0 && fs::exists(run))
      ADD_FAILURE() << target << ": a failed fresh run left " << run << " behind";
    fs::remove_all(run);
  }
}

TEST_F(Fuzz, Checkpoints) {
  Tally model{"model"}, optimizer{"optimizer"}, state{"state.json"}, latest{"latest"}, config{"config.toml"};
  const fs::path run = scratch_ / "run";
  for (int64_t i = 0; i < scaled(900); ++i) {
    fs::remove_all(run);
    fs::copy(base_->path / "run", run, fs::copy_options::recursive);
    const fs::path ck = run / "checkpoints" / "step_00000002";
    const uint64_t kind = pick(20);
    fs::path target;
    Tally* tally;
    if (kind < 7) {
      target = ck / "model.safetensors", tally = &model;
      write_text(target, mutate_safetensors(read_file(target)));
    } else if (kind < 10) {
      target = ck / "optimizer.safetensors", tally = &optimizer;
      write_text(target, mutate_safetensors(read_file(target)));
    } else if (kind < 16) {
      target = ck / "state.json", tally = &state;
      nlohmann::json j = nlohmann::json::parse(read_file(target));
      const std::string field = one_of<std::string>({"step", "tokens_seen", "epoch", "index", "seed", "rng_state",
                                                     "config", "whole"});
      if (field == "epoch" || field == "index") j["data"][field] = hostile_json();
      else if (field == "rng_state") j[field] = pick(2) ? nlohmann::json(j[field].get<std::string>().substr(0, pick(10000))) : hostile_json();
      else if (field == "config") j[field] = mutate_bytes(j[field].get<std::string>());
      else if (field != "whole") j[field] = hostile_json();
      if (pick(8) == 0) j.erase(field);
      const std::string text = j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
      write_text(target, field == "whole" ? mutate_bytes(text) : text);
    } else if (kind < 18) {
      target = run / "checkpoints" / "latest", tally = &latest;
      write_text(target, one_of<std::string>({"step_00000002\r\n", std::string("step_0000\0" "002\n", 14), "", "\n",
                                              "step_\n", "../../x\n", "step_99999999\n", "step_00000001\nstep_2\n",
                                              mutate_bytes("step_00000002\n")}));
    } else {
      target = run / "config.toml", tally = &config;
      write_text(target, mutate_bytes(read_file(target)));
    }
    const auto before = snapshot(run);
    const bool resume = pick(3) == 0;
    const Outcome o = resume ? run_cli({"train", "--resume", "--run-dir", run.string(), "--set", "train.steps=3"}, scratch_)
                             : run_cli({"eval", "--run-dir", run.string(), "--tokens", "64"}, scratch_);
    // A mutated config.toml may name another data directory, or a vocabulary its data's meta.json
    // exceeds: the message then names that directory or file.
    if (tally->check(o, {run.string(), "data directory", (base_->path / "data").string()}, target.filename().string() + (resume ? " (resume)" : " (eval)")) &&
        o.rc != 0 && snapshot(run) != before)
      ADD_FAILURE() << target << ": a failed command changed the run directory";
  }
}

TEST_F(Fuzz, TokenFiles) {
  Tally npy{"npy"}, text{"text ids"};
  const fs::path out = scratch_ / "logits.safetensors";
  for (int64_t i = 0; i < scaled(480); ++i) {
    const bool as_npy = pick(3) != 0;
    const fs::path file = scratch_ / (as_npy ? "ids.npy" : "ids.txt");
    std::string bytes;
    if (as_npy) {
      bytes = npy_;
      const size_t shape = bytes.find("(2, 8)");
      switch (pick(5)) {
        case 0:
          bytes.replace(shape, 6, one_of<std::string>({"(99999999999, 5)", "(-1,)", "()", "(2, 3, 4)", "(0, 5)",
                                                       "(4611686018427387904, 4)", "(1e3,)", "(2, 0)", "(3, 8)", "(16,)",
                                                       "(18446744073709551617,)", "(2,, 8)"}));
          break;
        case 1: bytes.replace(bytes.find("<i4"), 3, one_of<std::string>({"<f4", ">i4", "<i8", "|u1", "<u8", "", "<i4'"})); break;
        case 2: bytes[8 + pick(2)] = char(pick(256)); break;
        case 3: bytes.resize(pick(bytes.size())); break;
        default: bytes = mutate_bytes(bytes);
      }
    } else {
      bytes = pick(2) ? mutate_bytes(tokens_text_)
                      : one_of<std::string>({"18446744073709551615 1\n", "-3 1\n", "1 2\n\n3\n", "", "\n\n",
                                             "9223372036854775807 1\n", "1 99999\n", std::string("1 \0 2\n", 6)});
    }
    write_text(file, bytes);
    const Outcome o = run_cli({"forward", "--checkpoint", (base_->path / "ck").string(), "--tokens", file.string(),
                               "--out", out.string()},
                              scratch_);
    if ((as_npy ? npy : text).check(o, {file.string()}, file.filename().string()) && o.rc != 0 &&
        (fs::exists(out) || fs::exists(out.string() + ".tmp")))
      ADD_FAILURE() << "a failed forward left its output behind";
    fs::remove_all(out);
  }
}


// What is under `dir` by path, size and modification time: cheap enough to take around every case,
// and enough to see a file removed, added or rewritten.
std::map<std::string, std::string> stat_snapshot(const fs::path& dir, const fs::path& skip) {
  std::map<std::string, std::string> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (it->path() == skip) {
      it.disable_recursion_pending();
      continue;
    }
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0) continue;
    out[it->path().string()] = cat(st.st_mode, " ", st.st_size, " ", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
  }
  return out;
}

// A small real corpus prepared with a real tokenizer, a run trained on it for two steps, and a
// task file: what commands that decode text (generate, make-task, eval --task) need. Made once.
struct TextFixture {
  fs::path corpus, data, run, task, config, spec, ids, points, lines;
};

TextFixture make_text_fixture(const fs::path& base, const fs::path& scratch) {
  TextFixture f;
  f.corpus = base / "corpus";
  fs::create_directories(f.corpus);
  const fs::path docs = "/usr/share/doc/python3.11/html/_sources/tutorial";
  int n = 0;
  for (const auto& e : fs::directory_iterator(docs))
    if (e.is_regular_file() && n++ < 8) fs::copy_file(e.path(), f.corpus / e.path().filename());
  f.data = base / "text-data";
  Outcome o = run_cli({"data", "prepare", "--input", f.corpus.string(), "--out", f.data.string(), "--vocab-size", "400",
                       "--val-fraction", "0.3"},
                      scratch);
  EXPECT_EQ(o.rc, 0) << o.err;
  f.config = base / "text.toml";
  write_text(f.config, "[model]\nn_layers = 1\nd_model = 32\nn_heads = 4\nn_kv_heads = 2\nd_ff = 64\nvocab_size = 400\n"
                       "seq_len = 32\n[residual]\nkind = \"dar\"\nblock_sublayers = 2\n[data]\ndir = \"" + f.data.string() +
                       "\"\n[train]\nmicro_batch = 2\nsteps = 2\n"
                       "eval_every = 0\neval_tokens = 64\ncheckpoint_every = 1\nlog_every = 1\nthreads = 1\n"
                       "[optim]\nwarmup_steps = 1\n");
  f.run = base / "text-run";
  o = run_cli({"train", "--config", f.config.string(), "--run-dir", f.run.string()}, scratch);
  EXPECT_EQ(o.rc, 0) << o.err;
  f.task = base / "task.jsonl";
  write_text(f.task, "{\"context\": \"The list\", \"choices\": [\" is\", \" was\"], \"gold\": 0}\n"
                     "{\"context\": \"A tuple\", \"choices\": [\" is\", \" of\"], \"gold\": 1}\n");
  f.spec = base / "spec.toml";
  write_text(f.spec, "base = \"" + f.config.string() + "\"\nseeds = [1]\n[[run]]\nname = \"residual\"\nkind = \"residual\"\n");
  f.ids = base / "ids.txt";
  write_text(f.ids, "1 2 3 4\n");
  f.lines = base / "lines.jsonl";
  write_text(f.lines, "\"The list\"\n{\"b64\": \"/w==\"}\n");
  f.points = base / "runs.csv";
  write_text(f.points, "method,compute,loss\nresidual,1e15,3.1\nresidual,1e16,2.6\nresidual,1e17,2.2\nresidual,1e18,1.9\n"
                       "dar,1e15,3.0\ndar,1e16,2.5\ndar,1e17,2.1\ndar,1e18,1.85\n");
  return f;
}

// For every command, a command line that succeeds quickly: the option under test replaces its value
// here, or is added.
std::map<std::string, std::vector<std::string>> cheap_command_lines(const TextFixture& f, const fs::path& scratch) {
  const std::string cfg = f.config.string(), out = (scratch / "out").string();
  return {
      {"data prepare", {"--input", f.corpus.string(), "--out", out, "--tokenizer", (f.data / "tokenizer.model").string(),
                        "--val-fraction", "0.3"}},
      {"data encode", {"--tokenizer", (f.data / "tokenizer.model").string(), "--input", f.lines.string()}},
      {"data make-task", {"--data", f.data.string(), "--out", (scratch / "task.jsonl").string(), "--items", "2",
                          "--dev-items", "0", "--choices", "2"}},
      {"train", {"--config", cfg, "--run-dir", (scratch / "run").string(), "--set", "train.steps=1"}},
      {"eval", {"--run-dir", f.run.string(), "--tokens", "64"}},
      {"params", {"--config", cfg}},
      {"bench", {"--config", cfg, "--steps", "1", "--warmup", "0"}},
      {"info", {}},
      {"init", {"--config", cfg, "--out", out}},
      {"forward", {"--checkpoint", f.run.string(), "--tokens", f.ids.string(), "--out", (scratch / "logits.safetensors").string()}},
      {"generate", {"--run-dir", f.run.string(), "--prompt", "The list", "--max-new-tokens", "2"}},
      {"compare", {"--spec", f.spec.string(), "--out", out}},
      {"analyze", {"--run-dir", f.run.string(), "--what", "maps", "--sequences", "1", "--positions", "4", "--out", out}},
      {"cost", {"--config", cfg}},
      {"plan", {"--config", cfg, "--gpus", "2", "--gpu-memory", "80GiB"}},
      {"scaling", {"--runs", f.points.string(), "--plot", (scratch / "fit.png").string()}},
  };
}

// Values wrong for an option of type `type` (its help's "INT in [1, 1024]", "UINT >= 0", "FLOAT
// in [0, 1]"): every one must be refused, naming the option. Empty for a text option.
std::vector<std::string> wrong_numbers(const std::string& type) {
  const bool is_int = type.starts_with("INT"), is_uint = type.starts_with("UINT"), is_float = type.starts_with("FLOAT");
  if (!is_int && !is_uint && !is_float) return {};
  std::vector<std::string> v = {"", "abc", " 1", "1 ", "+1", "0x10", "1,5", "nan", "inf", "-inf"};
  if (is_float) v.insert(v.end(), {"1e999", "-1e999", "0x1p3", "1.5.2"});
  else v.insert(v.end(), {"1.5", "1e3", "99999999999999999999", "-99999999999999999999", "18446744073709551616"});
  if (is_uint) v.insert(v.end(), {"-1", "-0"});
  // Just past the range the help states ("in [1, 1024]", "in (0, 1]", ">= 1"), and an open end itself.
  long double lo = 0, hi = 0;
  char open = 0, close = 0;
  if (std::sscanf(type.c_str(), "%*s in %c%Lf, %Lf%c", &open, &lo, &hi, &close) == 4) {
    v.push_back(is_float ? cat(double(lo) - 1) : std::to_string((long long)lo - 1));
    v.push_back(is_float ? cat(double(hi) * 2 + 1) : std::to_string((long long)hi + 1));
    if (open == '(') v.push_back(cat(double(lo)));
    if (close == ')') v.push_back(cat(double(hi)));
  } else if (std::sscanf(type.c_str(), "%*s >= %Lf", &lo) == 1 && lo > 0) {
    v.push_back(is_float ? cat(double(lo) / 2) : std::to_string((long long)lo - 1));
  }
  return v;
}

TEST_F(Fuzz, Options) {
  Tally numbers{"options#"}, texts{"options"};
  const fs::path base = base_->path / "options";
  fs::create_directories(base);
  const TextFixture f = make_text_fixture(base, scratch_);
  // Paths of every kind, none of them the fixture's own files, made afresh for each case (a command
  // may rightly write into a directory or over a file it is given as an output).
  const fs::path places = scratch_ / "places";
  auto make_places = [&] {
    fs::create_directories(places / "dir");
    write_text(places / "file", "not what any option wants\n");
    ASSERT_EQ(::mkfifo((places / "fifo").c_str(), 0644), 0);
    // A character device, as /dev/null (only root may make one: elsewhere the path stays missing).
    (void)::mknod((places / "null").c_str(), S_IFCHR | 0666, makedev(1, 3));
  };
  const std::vector<std::string> wrong_texts = {"", std::string("bad\x01name"), (places / "null").string(),
                                                (places / "fifo").string(), (places / "dir").string(),
                                                (places / "file").string(), (places / "missing" / "x").string()};
  CLI::App app;
  cli::Action action;
  cli::add_commands(app, action);
  std::vector<std::pair<std::string, const CLI::App*>> commands;
  for (const CLI::App* cmd : app.get_subcommands([](const CLI::App*) { return true; })) {
    const auto subs = cmd->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) commands.emplace_back(cmd->get_name(), cmd);
    for (const CLI::App* sub : subs) commands.emplace_back(cmd->get_name() + " " + sub->get_name(), sub);
  }
  int64_t options = 0;
  for (const auto& [name, cmd] : commands) {
    const auto lines = cheap_command_lines(f, scratch_);
    ASSERT_TRUE(lines.count(name)) << "no cheap command line for '" << name << "': add one to cheap_command_lines";
    for (const CLI::Option* opt : cmd->get_options()) {
      // Options that take a value (not flags, --help among them).
      if (opt->get_expected_max() == 0 || opt->get_name().rfind("--", 0) != 0) continue;
      ++options;
      const std::string option = opt->get_name();
      const std::vector<std::string> numbers_wrong = wrong_numbers(opt->get_type_name());
      const bool numeric = !numbers_wrong.empty();
      for (const std::string& value : numeric ? numbers_wrong : wrong_texts) {
        std::vector<std::string> args;
        std::istringstream words(name);
        for (std::string w; words >> w;) args.push_back(w);
        const std::vector<std::string>& line = lines.at(name);
        for (size_t i = 0; i < line.size(); ++i) {
          if (line[i] == option && option != "--set") {
            ++i;  // the base value gives way to the hostile one
            continue;
          }
          args.push_back(line[i]);
        }
        args.insert(args.end(), {option, value});
        make_places();
        const auto before = stat_snapshot(base_->path, scratch_);
        // (The plots' Python is `true`: a figure is drawn by matplotlib, not by depthkit.)
        const Outcome o = run_cli(args, scratch_, {{"DEPTHKIT_PYTHON", "true"}});
        const std::string what = cat(name, " ", option, " '", printable(value), "'");
        if (numeric || value.empty()) {
          // A wrong number, or any option given an empty value, is bad usage: exit 2, naming it.
          if ((numeric ? numbers : texts).check(o, {option}, what) && o.rc != 2)
            ADD_FAILURE() << what << ": accepted or exit " << o.rc;
        } else {
          texts.check(o, {option, printable(value), value.empty() ? option : printable(value)}, what);
        }
        if (stat_snapshot(base_->path, scratch_) != before) ADD_FAILURE() << what << ": changed the inputs";
        fs::remove_all(scratch_);
        fs::create_directories(scratch_);
      }
    }
  }
  std::printf("fuzz options: %lld options of %zu commands\n", (long long)options, commands.size());
  EXPECT_GT(options, 40);
}

// torchrun's variables with wrong values, on a job of two whose other rank never comes: each case
// ends in one line naming the variable (or the store it points to) within train.timeout_s.
TEST_F(Fuzz, LaunchVariables) {
  Tally tally{"launch"};
  const std::vector<std::string> variables = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                              "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"};
  const std::vector<std::string> values = {"", "-1", "abc", "1.5", " 1", "99999999999999999999", "0x1", "65536", "3"};
  // A port the kernel says is free: no other job's store answers there.
  std::string port;
  {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = std::to_string(ntohs(addr.sin_port));
    ::close(fd);
  }
  for (const std::string& variable : variables) {
    for (const std::string& value : values) {
      Env env = {{"WORLD_SIZE", "2"}, {"RANK", pick(2) ? "1" : "0"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                 {"LOCAL_RANK", std::nullopt}, {"LOCAL_WORLD_SIZE", std::nullopt},
                 {"TORCHELASTIC_USE_AGENT_STORE", std::nullopt}, {"TORCHELASTIC_RESTART_COUNT", std::nullopt}};
      for (auto& [name, v] : env)
        if (name == variable) v = value;
      const fs::path run = scratch_ / "run";
      const Outcome o = run_cli({"train", "--config", (base_->path / "base.toml").string(), "--run-dir", run.string(),
                                 "--set", "train.timeout_s=0.3"},
                                scratch_, env);
      const std::string what = cat(variable, "='", printable(value), "'");
      // A value that is not a plain number (or any value of the agent flag) must be refused by name;
      // others may be taken, and the job then fails at its rendezvous.
      const bool plain = !value.empty() && value.size() < 10 && value.find_first_not_of("0123456789") == std::string::npos;
      const bool must_name = variable == "TORCHELASTIC_USE_AGENT_STORE" || (variable != "MASTER_ADDR" && !plain);
      const std::vector<std::string> names =
          must_name ? std::vector<std::string>{"environment variable " + variable} : std::vector<std::string>{variable, "MASTER_ADDR", "never joined"};
      if (tally.check(o, names, what) && o.rc == 0)
        ADD_FAILURE() << what << ": a rank whose peer never came succeeded";
      if (fs::exists(run)) ADD_FAILURE() << what << ": a job that never started left " << run;
      fs::remove_all(run);
    }
  }
}

// Files and directories where they must not be taken: each refused in one line naming it, with
// nothing removed or changed; and the cases that must succeed do, saying what they did.
TEST_F(Fuzz, Files) {
  Tally tally{"files"};
  const fs::path base = base_->path / "files";
  fs::create_directories(base);
  const TextFixture f = make_text_fixture(base, scratch_);
  const fs::path corpus = f.corpus, sibling = base / "sibling.txt";
  write_text(sibling, "unrelated\n");
  const std::string prep_out = (scratch_ / "prepared").string();
  auto prepare = [&](std::vector<std::string> inputs, const std::string& out, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"data", "prepare", "--input"};
    args.insert(args.end(), inputs.begin(), inputs.end());
    args.insert(args.end(), {"--out", out, "--val-fraction", "0.3"});
    if (std::find(extra.begin(), extra.end(), "--vocab-size") == extra.end()) extra.insert(extra.end(), {"--vocab-size", "400"});
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  struct Case {
    std::string what;
    std::vector<std::string> args;
    std::vector<std::string> names;  // the message names one of these
    std::function<void()> setup = {}, teardown = {};
  };
  const fs::path odd = corpus / "odd";
  const std::vector<Case> cases = {
      {"--out an input, --force", prepare({corpus.string()}, corpus.string(), {"--force"}), {corpus.string()}},
      {"--out the parent of an input, --force", prepare({corpus.string()}, base.string(), {"--force"}), {base.string()}},
      {"--out inside an input", prepare({corpus.string()}, (corpus / "out").string()), {(corpus / "out").string()}},
      {"--input X X", prepare({corpus.string(), corpus.string()}, prep_out), {corpus.string()}},
      {"--input a directory and a file in it", prepare({corpus.string(), (corpus / "introduction.rst.txt").string()}, prep_out),
       {"introduction.rst.txt"}},
      {"a FIFO in an input directory", prepare({corpus.string()}, prep_out), {odd.string()},
       [&] { ::mkfifo(odd.c_str(), 0644); }, [&] { fs::remove(odd); }},
      {"a socket in an input directory", prepare({corpus.string()}, prep_out), {odd.string()},
       [&] {
         const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
         sockaddr_un addr{};
         addr.sun_family = AF_UNIX;
         std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", odd.c_str());
         ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
         ::close(fd);
       },
       [&] { fs::remove(odd); }},
      {"a dangling symbolic link in an input directory", prepare({corpus.string()}, prep_out), {odd.string()},
       [&] { fs::create_symlink("nowhere", odd); }, [&] { fs::remove(odd); }},
      {"a character device as an input", prepare({(base / "null").string()}, prep_out), {(base / "null").string()},
       [&] { ::mknod((base / "null").c_str(), S_IFCHR | 0666, makedev(1, 3)); }, [&] { fs::remove(base / "null"); }},
      {"--vocab-size below what the corpus needs", prepare({corpus.string()}, prep_out, {"--vocab-size", "300"}),
       {"--vocab-size 300"}},
      {"--force over a directory data prepare did not write", prepare({corpus.string()}, (base / "mine").string(), {"--force"}),
       {(base / "mine").string()}, [&] { fs::create_directories(base / "mine"); write_text(base / "mine" / "notes", "x"); },
       [&] { fs::remove_all(base / "mine"); }},
      {"--force over a file", prepare({corpus.string()}, sibling.string(), {"--force"}), {sibling.string()}},
      {"make-task --force over an input", {"data", "make-task", "--data", f.data.string(), "--out",
                                           (f.data / "meta.json").string(), "--force"}, {(f.data / "meta.json").string()}},
      {"make-task --force over a file it did not write", {"data", "make-task", "--data", f.data.string(), "--out",
                                                          sibling.string(), "--force"}, {sibling.string()}},
      {"init --force over a directory of documents", {"init", "--config", f.config.string(), "--out", corpus.string(),
                                                      "--force"}, {corpus.string()}},
      {"a NUL byte in a task line", {"eval", "--run-dir", f.run.string(), "--task", (base / "nul.jsonl").string()},
       {(base / "nul.jsonl").string()},
       [&] { write_text(base / "nul.jsonl", "{\"context\":\"ab\",\"choices\":[\"x\",\"y\"],\"gold\":0}" + std::string(1, '\0') +
                                                  "{\"gold\": 7}\n"); },
       [&] { fs::remove(base / "nul.jsonl"); }},
      {"a regular file as --run-dir (eval)", {"eval", "--run-dir", sibling.string()}, {sibling.string()}},
      {"a regular file as --run-dir (generate)", {"generate", "--run-dir", sibling.string(), "--prompt", "x"}, {sibling.string()}},
      {"a regular file as --run-dir (analyze)", {"analyze", "--run-dir", sibling.string()}, {sibling.string()}},
      {"a regular file as --run-dir (resume)", {"train", "--resume", "--run-dir", sibling.string()}, {sibling.string()}},
  };
  for (const Case& c : cases) {
    if (c.setup) c.setup();
    const auto before = stat_snapshot(base_->path, scratch_);
    const Outcome o = run_cli(c.args, scratch_);
    if (tally.check(o, c.names, c.what) && o.rc == 0) ADD_FAILURE() << c.what << ": accepted";
    if (stat_snapshot(base_->path, scratch_) != before) ADD_FAILURE() << c.what << ": changed or removed files";
    if (fs::exists(prep_out)) ADD_FAILURE() << c.what << ": left " << prep_out;
    if (c.teardown) c.teardown();
    fs::remove_all(scratch_);
    fs::create_directories(scratch_);
  }
  // A vocabulary larger than the corpus can fill: done with the pieces there are, said in one
  // line, and recorded.
  const Outcome o = run_cli(prepare({corpus.string()}, prep_out, {"--vocab-size", "200000"}), scratch_);
  EXPECT_EQ(o.rc, 0) << o.err;
  EXPECT_NE(o.err.find("fewer than --vocab-size 200000"), std::string::npos) << o.err;
  const nlohmann::json meta = nlohmann::json::parse(read_file(fs::path(prep_out) / "meta.json"));
  EXPECT_EQ(meta["vocab_size_requested"], 200000);
  EXPECT_LT(meta["vocab_size"].get<int64_t>(), 200000);
}

}  // namespace
}  // namespace depthkit::test
