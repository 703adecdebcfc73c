#include "depthkit/dist/world.h"

// ProcessGroupGloo is declared only when USE_C10D_GLOO is defined (as LibTorch itself was built);
// Gloo's own headers come from Debian's libgloo-dev (scripts/setup).
#define USE_C10D_GLOO 1
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <utility>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "depthkit/dist/nccl.h"
#include "depthkit/util/error.h"
#include "depthkit/util/numbers.h"

namespace depthkit {

namespace {

using namespace std::chrono_literals;
constexpr auto kHeartbeat = 250ms;  // how often each rank says it is alive
constexpr auto kSilence = 1500ms;   // a rank whose heartbeat stops this long is gone

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const auto v = env(name);
  return v ? parse_int(*v, lo, hi, cat("environment variable ", name)) : fallback;
}

std::string key_of(const char* what, int64_t rank) { return cat(what, "/", rank); }

std::string as_string(const std::vector<uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }

using Json = nlohmann::json;

Json facts_json(const World::Facts& facts) {
  Json j = Json::object();
  for (const auto& [name, value] : facts) j[name] = value;
  return j;
}

// How the ranks' facts differ from rank 0's, or "" when they agree: "rank 1 differs from rank 0:
// train.seed = 2 (rank 0: 1), optim.lr = 0.001 (rank 0: 0.003)". The same text on every rank.
std::string differences(const std::vector<Json>& facts) {
  constexpr int kRanksShown = 3, kKeysShown = 4;
  auto value = [](const Json& f, const std::string& key) {
    if (!f.is_object() || !f.contains(key)) return std::string("(none)");
    return printable(f[key].is_string() ? f[key].get<std::string>() : f[key].dump());
  };
  std::string out;
  int ranks_differing = 0;
  for (size_t r = 1; r < facts.size(); ++r) {
    std::vector<std::string> keys;
    for (const auto& [key, v] : facts[0].items())
      if (value(facts[r], key) != value(facts[0], key)) keys.push_back(key);
    for (const auto& [key, v] : facts[r].items())
      if (!facts[0].is_object() || !facts[0].contains(key)) keys.push_back(key);
    if (keys.empty()) continue;
    if (++ranks_differing > kRanksShown) continue;
    std::string line = cat("rank ", r, " differs from rank 0: ");
    for (size_t k = 0; k < keys.size() && k < size_t(kKeysShown); ++k)
      line += cat(k ? ", " : "", keys[k], " = ", value(facts[r], keys[k]), " (rank 0: ", value(facts[0], keys[k]), ")");
    if (keys.size() > size_t(kKeysShown)) line += cat(" and ", keys.size() - kKeysShown, " more");
    out += (out.empty() ? "" : "; ") + line;
  }
  if (ranks_differing > kRanksShown) out += cat("; and ", ranks_differing - kRanksShown, " more ranks");
  return out;
}

}  // namespace

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv e;
  e.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  e.rank = env_int("RANK", 0, 0, e.world_size - 1);
  // LOCAL_RANK picks the GPU; a single process may set it alone (LOCAL_RANK=1: the second GPU).
  const bool local_size_given = env("LOCAL_WORLD_SIZE").has_value();
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", e.world_size, 1, e.world_size);
  e.local_rank = env_int("LOCAL_RANK", e.rank % e.local_world_size, 0, local_size_given ? e.local_world_size - 1 : 1 << 20);
  if (e.world_size > 1) {
    const auto addr = env("MASTER_ADDR");
    if (!addr || addr->empty()) fail("environment variable MASTER_ADDR is not set (WORLD_SIZE is ", e.world_size, ")");
    e.master_addr = *addr;
    if (!env("MASTER_PORT")) fail("environment variable MASTER_PORT is not set (WORLD_SIZE is ", e.world_size, ")");
    e.master_port = env_int("MASTER_PORT", 0, 1, 65535);
  }
  // torchrun writes "True" or "False"; anything else is a mistake, not a quiet "no".
  if (const auto agent = env("TORCHELASTIC_USE_AGENT_STORE")) {
    const std::string& a = *agent;
    if (a != "True" && a != "true" && a != "1" && a != "False" && a != "false" && a != "0")
      fail("environment variable TORCHELASTIC_USE_AGENT_STORE='", printable(a), "' must be True or False");
    e.agent_store = a == "True" || a == "true" || a == "1";
  }
  e.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0, 0, INT32_MAX);
  return e;
}

struct World::Impl {
  int64_t rank = 0, size = 1;
  std::string store_host;
  uint16_t store_port = 0;
  std::string store_address;
  bool agent_store = false;
  c10::intrusive_ptr<c10d::Store> store;  // the job's keys, under a prefix of its attempt
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::chrono::milliseconds timeout{0};
  std::thread heartbeat;
  std::atomic<bool> stopping{false};
  std::atomic<int64_t> step{0};
  bool broken = false;  // a collective failed: the group must not be used or torn down

  ~Impl() {
    stopping.store(true);
    if (heartbeat.joinable()) heartbeat.join();
    // Gloo's pairs to a dead peer cannot be closed cleanly: leave the group to the process's exit.
    if (broken) (void)group.release();
  }

  at::Device device = at::kCPU;  // where the backend's tensors live (CUDA for NCCL)
  std::string backend, master_addr;  // what World::group needs for further groups

  // A new connection to the job's store that gives up after a few seconds: for reading what the
  // other ranks published once something failed (the job's own connection may be mid-request,
  // and its timeout is train.timeout_s).
  c10::intrusive_ptr<c10d::Store> quick_store() const {
    c10d::TCPStoreOptions opts;
    opts.port = store_port;
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(5000);
    auto tcp = c10::make_intrusive<c10d::TCPStore>(store_host, opts);
    return c10::make_intrusive<c10d::PrefixStore>(prefix, tcp);
  }
  std::string prefix;

  void publish(const char* what, const std::string& text) const {
    try {
      quick_store()->set(key_of(what, rank), text);
    } catch (const std::exception&) {  // the store is gone: nobody is left to read it
    }
  }

  // "beat step" of every rank's heartbeat, or nullopt for a rank that never published one.
  std::map<int64_t, std::string> heartbeats(c10d::Store& s) const {
    std::map<int64_t, std::string> out;
    for (int64_t r = 0; r < size; ++r)
      if (s.check({key_of("heartbeat", r)})) out[r] = as_string(s.get(key_of("heartbeat", r)));
    return out;
  }

  // What another rank published when it stopped: its own failure ("rank 1 failed: ..."), else the
  // cause it found; "" when none did.
  std::string published(c10d::Store& s) const {
    for (int64_t r = 0; r < size; ++r)
      if (r != rank && s.check({key_of("failed", r)})) return cat("rank ", r, " failed: ", as_string(s.get(key_of("failed", r))));
    for (int64_t r = 0; r < size; ++r)
      if (r != rank && s.check({key_of("stopped", r)})) return as_string(s.get(key_of("stopped", r)));
    return "";
  }

  // The one line that explains why the job stopped, read from the store by a rank whose
  // collective failed: a rank that published its own failure, else the cause another rank found
  // first, else a rank whose heartbeat stopped, else the rank that lags behind this one. Empty
  // when nothing explains it (then the failure is this rank's own).
  std::string diagnose() const {
    try {
      auto s = quick_store();
      if (std::string cause = published(*s); !cause.empty()) return cause;
      const auto before = heartbeats(*s);
      std::this_thread::sleep_for(kSilence);
      if (std::string cause = published(*s); !cause.empty()) return cause;
      const auto after = heartbeats(*s);
      for (int64_t r = 0; r < size; ++r) {
        if (r == rank) continue;
        if (!after.count(r)) return cat("rank ", r, " never joined the job");
        if (before.count(r) && before.at(r) == after.at(r))
          return cat("rank ", r, " is gone (no heartbeat for ", kSilence.count() / 1000.0, " s: killed, crashed or stopped)");
      }
      // Everyone is alive: the one that lags is stuck (it did not reach the collective in time).
      int64_t lagging = -1, lag_step = step.load();
      for (const auto& [r, beat] : after) {
        const int64_t s_r = std::stoll(beat.substr(beat.find(' ') + 1));
        if (s_r < lag_step) lagging = r, lag_step = s_r;
      }
      if (lagging >= 0)
        return cat("rank ", lagging, " is stuck at step ", lag_step, " while rank ", rank, " waited at step ",
                   step.load(), " for ", timeout.count() / 1000.0, " s (train.timeout_s)");
      return "";
    } catch (const std::exception&) {
      // The store itself is gone: where rank 0 hosts it, rank 0 died with it.
      return agent_store ? cat("the job's rendezvous store at ", store_address, " (its launcher) no longer answers")
                         : cat("rank 0 is gone (the rendezvous store it hosted at ", store_address, " no longer answers)");
    }
  }

  int64_t rounds = 0;  // agreements made so far: every rank makes the same ones, in the same order

  // Each process claims its RANK once in the store: a second process launched with the same RANK
  // would otherwise wait for a rank that never comes, or join the group in another's place.
  void check_claim(int64_t claims) const {
    if (claims > 1)
      fail("RANK=", rank, " is claimed by ", claims, " processes of this job (at ", store_address,
           "): each process needs its own RANK in [0, WORLD_SIZE)");
  }

  // Publishes this rank's `mine` for `round` and returns every rank's, in rank order, each handed
  // to `arrived` as it comes (rank 0's first, so that a rank launched unlike rank 0 is named
  // without waiting for the others). Waits at most `timeout`: a rank that never published a
  // heartbeat is named as never joined, one whose heartbeat stops meanwhile as gone, at once.
  // The store's own failures (its host gone) are CollectiveErrors, explained as a collective's are.
  std::vector<Json> exchange(const std::string& round, const Json& mine, const std::string& what,
                             const std::function<void(int64_t, const Json&)>& arrived) {
    try {
      return exchange_through_store(round, mine, what, arrived);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw CollectiveError(one_line(e));
    }
  }

  // Every rank counts itself in once it has read every rank's entry of `round`; the rank that hosts
  // the store (rank 0 without an agent store) then waits until all have, at most 2 × kSilence (a
  // rank that died meanwhile is not waited for longer). What a round shows may end a rank (ranks
  // that disagree, a rank that failed): the host must not take the store down with it while another
  // rank still reads, or that rank says "rank 0 is gone" instead of the disagreement.
  void linger_until_read(const std::string& round) {
    const std::string readers = cat(round, "/read");
    int64_t read = store->add(readers, 1);
    if (rank != 0 || agent_store) return;
    const auto until = std::chrono::steady_clock::now() + 2 * kSilence;
    while (read < size && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(5ms);
      read = store->add(readers, 0);
    }
  }

  // The host, ended by what a round showed before every rank read it (a rank launched with another
  // WORLD_SIZE), waits until the ranks it knows of have read its own entry, at most 2 × kSilence:
  // each then names the disagreement itself, instead of "rank 0 is gone".
  void linger_until_host_read(const std::string& round) {
    if (rank != 0 || agent_store) return;
    const auto until = std::chrono::steady_clock::now() + 2 * kSilence;
    while (store->add(cat(round, "/read0"), 0) < size && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(5ms);
  }

  std::vector<Json> exchange_through_store(const std::string& round, const Json& mine, const std::string& what,
                                           const std::function<void(int64_t, const Json&)>& arrived) {
    const auto key = [&](int64_t r) { return cat(round, "/", r); };
    store->set(key(rank), mine.dump());
    std::vector<Json> all(size);
    int64_t next = 0;  // ranks are read in order: rank 0 first, and one request per wait
    const auto start = std::chrono::steady_clock::now();
    auto last_look = start;
    auto last_beats = heartbeats(*store);
    for (;;) {
      while (next < size && store->check({key(next)})) {
        all[next] = Json::parse(as_string(store->get(key(next))), nullptr, false);
        if (next == 0) store->add(cat(round, "/read0"), 1);  // the host may wait for this (below)
        if (arrived) try {
            arrived(next, all[next]);
          } catch (const Error&) {  // a disagreement ends this rank: let the others read the host's entry first
            linger_until_host_read(round);
            throw;
          }
        ++next;
      }
      if (next == size) {
        linger_until_read(round);
        return all;
      }
      // A rank that is not coming: the cause it published when it stopped, or else how it is missing.
      auto stop = [&](const std::string& missing_rank) {
        const std::string cause = published(*store);
        throw JobStopped(cat("rank ", rank, " stops: ", cause.empty() ? missing_rank : cause));
      };
      const auto now = std::chrono::steady_clock::now();
      if (now - start > timeout) {
        const auto beats = heartbeats(*store);
        stop(cat("rank ", next, beats.count(next) ? " did not reach " + what : std::string(" never joined the job"),
                 " within ", timeout.count() / 1000.0, " s (train.timeout_s)"));
      }
      if (now - last_look >= kSilence) {  // now and then: the heartbeats, and a RANK claimed twice
        check_claim(store->add(key_of("claim", rank), 0));
        const auto beats = heartbeats(*store);
        for (int64_t r = next; r < size; ++r)
          if (last_beats.count(r) && beats.count(r) && last_beats.at(r) == beats.at(r))
            stop(cat("rank ", r, " is gone (no heartbeat for ", kSilence.count() / 1000.0, " s during ", what,
                     ": killed, crashed or stopped)"));
        last_beats = beats;
        last_look = now;
      }
      std::this_thread::sleep_for(20ms);
    }
  }
};

namespace {

// The job's backend: "gloo" or "nccl", the store's address, this rank's device, the timeout.
struct Backend {
  std::string name, master_addr;
  at::Device device;
  std::chrono::milliseconds timeout;
};
// A process group of `size` ranks on the job's backend, meeting through `store`: Gloo over TCP
// (loopback when the job's address is), or NCCL on this rank's GPU.
c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const Backend& w, const c10::intrusive_ptr<c10d::Store>& store,
                                                          int64_t rank, int64_t size);

}  // namespace

struct Group::Impl {
  Impl(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device, std::chrono::milliseconds timeout)
      : pg(std::move(pg)), device(device), timeout(timeout) {}
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null for a group of one
  at::Device device;
  std::chrono::milliseconds timeout;
  // Waits for a collective; one that fails (a peer gone, the timeout) is a CollectiveError.
  void wait(const c10::intrusive_ptr<c10d::Work>& work) const {
    try {
      work->wait(timeout);
    } catch (const std::exception& e) {
      throw CollectiveError(one_line(e));
    }
  }
  // Runs `collective` on `t` moved to the backend's device, and copies the result back.
  template <class F>
  void on_device(at::Tensor& t, const F& collective) const {
    at::Tensor there = t.device() == device ? t : t.to(device);
    std::vector<at::Tensor> ts{there};
    wait(collective(ts));
    if (!there.is_same(t)) t.copy_(there);
  }
};

Group::Group(std::unique_ptr<Impl> impl, std::vector<int64_t> members, int64_t rank)
    : impl_(std::move(impl)), members_(std::move(members)), rank_(rank) {}
Group::~Group() = default;

World::World() : impl_(std::make_unique<Impl>()) {
  all_ = std::unique_ptr<Group>(new Group(std::make_unique<Group::Impl>(nullptr, at::kCPU, std::chrono::milliseconds(0)), {0}, 0));
}

World::World(const LaunchEnv& env, const std::string& backend, double timeout_s, const Facts& facts)
    : impl_(std::make_unique<Impl>()), rank_(env.rank), size_(env.world_size) {
  Impl& w = *impl_;
  // A write to a closed socket (a rank or the job's store gone) must fail as an error that this
  // rank then explains, not end the process with SIGPIPE before it can.
  std::signal(SIGPIPE, SIG_IGN);
  w.rank = env.rank;
  w.size = env.world_size;
  w.agent_store = env.agent_store;
  w.store_host = env.master_addr;
  w.store_port = uint16_t(env.master_port);
  w.store_address = cat(env.master_addr, ":", env.master_port);
  w.prefix = cat("depthkit/", env.restart_count);
  w.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000));
  c10d::TCPStoreOptions opts;
  opts.port = uint16_t(env.master_port);
  opts.isServer = env.rank == 0 && !env.agent_store;
  opts.numWorkers = std::nullopt;
  opts.waitWorkers = false;
  opts.timeout = w.timeout;
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    if (opts.isServer)  // a port in use: another job's store, or a second process launched as rank 0
      fail("rank 0: cannot host the rendezvous store at ", w.store_address, " (MASTER_ADDR:MASTER_PORT): ", one_line(e));
    fail("rank ", env.rank, ": cannot reach the rendezvous store at ", w.store_address, " (MASTER_ADDR:MASTER_PORT) within ",
         timeout_s, " s (train.timeout_s): ", one_line(e));
  }
  w.store = c10::make_intrusive<c10d::PrefixStore>(w.prefix, tcp);
  w.check_claim(w.store->add(key_of("claim", w.rank), 1));
  // The heartbeat starts before the group forms, so that a rank missing at start-up is named.
  w.store->set(key_of("heartbeat", w.rank), "0 0");
  w.heartbeat = std::thread([&w] {
    try {
      auto s = w.store->clone();
      for (int64_t beat = 1; !w.stopping.load(); ++beat) {
        s->set(key_of("heartbeat", w.rank), cat(beat, " ", w.step.load()));
        std::this_thread::sleep_for(kHeartbeat);
      }
    } catch (const std::exception&) {  // the store is gone; the next collective says so
    }
  });
  // The rendezvous: how each rank was launched and what it starts from, checked before the group
  // forms (a collective over tensors whose sizes differ between ranks aborts inside Gloo).
  World::Facts all_facts = {{"WORLD_SIZE", std::to_string(w.size)}};
  all_facts.insert(all_facts.end(), facts.begin(), facts.end());
  // A rank launched with another WORLD_SIZE is named as soon as its facts arrive.
  auto same_world_size = [&](int64_t r, const Json& theirs) {
    const Json facts = theirs.is_object() ? theirs.value("facts", Json::object()) : Json::object();
    const Json size = facts.is_object() ? facts.value("WORLD_SIZE", Json("?")) : Json("?");
    const std::string given = size.is_string() ? size.get<std::string>() : "?";
    if (given != std::to_string(w.size))
      fail("rank ", r, " was launched with WORLD_SIZE=", printable(given), " and rank ", w.rank, " with WORLD_SIZE=",
           w.size, ": every rank of a job needs the same");
  };
  std::vector<Json> launched;
  try {
    launched = w.exchange("launch", Json{{"facts", facts_json(all_facts)}}, "the rendezvous", same_world_size);
  } catch (const CollectiveError& e) {  // the store stopped answering
    const std::string why = w.diagnose();
    fail("rank ", w.rank, ": the rendezvous failed: ", why.empty() ? std::string(e.what()) : why);
  }
  std::vector<Json> launched_facts;
  for (const Json& j : launched) launched_facts.push_back(j.is_object() ? j.value("facts", Json::object()) : Json::object());
  if (const std::string d = differences(launched_facts); !d.empty())
    fail("the ranks were started differently (every rank of a job needs the same config and data); ", d);
  w.backend = backend;
  w.master_addr = env.master_addr;
  if (backend == "nccl") w.device = at::Device(at::kCUDA, c10::DeviceIndex(env.local_rank));
  try {
    w.group = make_process_group({w.backend, w.master_addr, w.device, w.timeout},
                                 c10::make_intrusive<c10d::PrefixStore>("group", w.store), w.rank, w.size);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string why = w.diagnose();
    w.broken = true;
    fail("rank ", w.rank, ": the ", backend, " process group did not form within ", timeout_s, " s (train.timeout_s)",
         why.empty() ? cat(": ", one_line(e)) : cat(": ", why));
  }
  std::vector<int64_t> everyone;
  for (int64_t r = 0; r < size_; ++r) everyone.push_back(r);
  all_ = std::unique_ptr<Group>(new Group(std::make_unique<Group::Impl>(w.group, w.device, w.timeout), everyone, rank_));
}

World::~World() = default;

void Group::all_reduce_sum(at::Tensor& t) {
  if (size() == 1) return;
  count("all_reduce", t.nbytes());
  impl_->on_device(t, [&](std::vector<at::Tensor>& ts) { return impl_->pg->allreduce(ts); });
}

void Group::broadcast(at::Tensor& t, int64_t root) {
  if (size() == 1) return;
  if (rank_ == root) count("broadcast", t.nbytes());
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  impl_->on_device(t, [&](std::vector<at::Tensor>& ts) { return impl_->pg->broadcast(ts, opts); });
}

at::Tensor Group::all_gather(const at::Tensor& shard) {
  if (size() == 1) return shard.clone();
  const at::Tensor in = shard.to(impl_->device).contiguous();
  at::Tensor out = at::empty({size() * in.numel()}, in.options());
  all_gather_into(in, out)->wait();
  return out.to(shard.device());
}

at::Tensor Group::all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                             const std::vector<int64_t>& recv_counts) {
  if (size() == 1) return input.clone();
  count("all_to_all", input.nbytes());
  int64_t received = 0;
  for (int64_t n : recv_counts) received += n;
  const at::Tensor in = input.to(impl_->device).contiguous();
  std::vector<int64_t> out_shape = in.sizes().vec();
  out_shape[0] = received;
  at::Tensor out = at::empty(out_shape, in.options());
  std::vector<int64_t> sends = send_counts, recvs = recv_counts;
  at::Tensor in_arg = in;
  impl_->wait(impl_->pg->alltoall_base(out, in_arg, recvs, sends));
  return out.to(input.device());
}

void Group::send(const at::Tensor& t, int64_t dst, int tag) { isend(t, dst, tag)->wait(); }

void Group::recv(at::Tensor& t, int64_t src, int tag) {
  impl_->on_device(t, [&](std::vector<at::Tensor>& ts) { return impl_->pg->recv(ts, int(src), tag); });
}

namespace {

class PendingWork final : public PendingCollective {
 public:
  PendingWork(c10::intrusive_ptr<c10d::Work> work, std::function<void(const c10::intrusive_ptr<c10d::Work>&)> wait)
      : work_(std::move(work)), wait_(std::move(wait)) {}
  void wait() override {
    if (work_) wait_(std::exchange(work_, {}));
  }
  bool done() const override { return !work_ || work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<void(const c10::intrusive_ptr<c10d::Work>&)> wait_;
};

class Done final : public PendingCollective {
 public:
  void wait() override {}
  bool done() const override { return true; }
};

}  // namespace

std::unique_ptr<PendingCollective> Group::isend(const at::Tensor& t, int64_t dst, int tag) {
  count("send", t.nbytes());
  std::vector<at::Tensor> ts{t.to(impl_->device).contiguous()};
  // The work keeps its tensors alive until it completes.
  return std::make_unique<PendingWork>(impl_->pg->send(ts, int(dst), tag),
                                       [impl = impl_.get(), ts](const c10::intrusive_ptr<c10d::Work>& w) { impl->wait(w); });
}

std::unique_ptr<PendingCollective> Group::reduce_scatter(const std::vector<at::Tensor>& pieces, at::Tensor out) {
  if (int64_t(pieces.size()) != size() || pieces[size_t(rank_)].numel() != out.numel())
    fail("Group::reduce_scatter: ", pieces.size(), " pieces for ", size(), " members, or this member's piece has ",
         pieces.empty() ? 0 : pieces[size_t(rank_)].numel(), " elements for an output of ", out.numel());
  if (size() == 1) {
    out.copy_(pieces[0]);
    return std::make_unique<Done>();
  }
  for (const at::Tensor& piece : pieces) count("reduce_scatter", piece.nbytes());
  std::vector<at::Tensor> outs{out};
  std::vector<std::vector<at::Tensor>> ins{pieces};
  return std::make_unique<PendingWork>(impl_->pg->reduce_scatter(outs, ins),
                                       [impl = impl_.get()](const c10::intrusive_ptr<c10d::Work>& w) { impl->wait(w); });
}

std::unique_ptr<PendingCollective> Group::all_gather_into(const at::Tensor& shard, at::Tensor out) {
  if (shard.dim() != 1 || out.dim() != 1 || out.numel() != size() * shard.numel() || !shard.is_contiguous() ||
      !out.is_contiguous())
    fail("Group::all_gather_into: a shard of ", shard.sizes(), " into ", out.sizes(), " for ", size(),
         " members; want 1-D contiguous tensors, the output size() times the shard");
  if (size() == 1) {
    out.copy_(shard);
    return std::make_unique<Done>();
  }
  if (shard.device() != impl_->device || out.device() != impl_->device)
    fail("Group::all_gather_into: tensors on ", shard.device(), " and ", out.device(), ", the process group's are on ",
         impl_->device);
  count("all_gather", shard.nbytes());
  std::vector<std::vector<at::Tensor>> outs(1);
  for (int64_t r = 0; r < size(); ++r) outs[0].push_back(out.narrow(0, r * shard.numel(), shard.numel()));
  std::vector<at::Tensor> ins{shard};
  return std::make_unique<PendingWork>(impl_->pg->allgather(outs, ins),
                                       [impl = impl_.get()](const c10::intrusive_ptr<c10d::Work>& w) { impl->wait(w); });
}

std::unique_ptr<Group> World::group(const std::string& name, const std::vector<int64_t>& members) {
  const auto place = std::find(members.begin(), members.end(), rank_);
  if (place == members.end() || !std::is_sorted(members.begin(), members.end()))
    fail("World::group '", name, "': rank ", rank_, " is not among its members, or they are not in order");
  const int64_t rank = place - members.begin();
  auto impl = [&](c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    return std::make_unique<Group::Impl>(std::move(pg), impl_->device, impl_->timeout);
  };
  if (members.size() == 1) return std::unique_ptr<Group>(new Group(impl(nullptr), members, 0));
  if (int64_t(members.size()) == size_) return std::unique_ptr<Group>(new Group(impl(impl_->group), members, rank));
  std::string key = "group/" + name;
  for (int64_t m : members) key += cat("-", m);
  try {
    auto pg = make_process_group({impl_->backend, impl_->master_addr, impl_->device, impl_->timeout},
                                 c10::make_intrusive<c10d::PrefixStore>(key, impl_->store), rank, int64_t(members.size()));
    return std::unique_ptr<Group>(new Group(impl(std::move(pg)), members, rank));
  } catch (const std::exception& e) {
    throw CollectiveError(cat("rank ", rank_, ": the process group '", name, "' did not form: ", one_line(e)));
  }
}

void World::agree(bool ok, const std::string& what, const Facts& facts) {
  if (!distributed()) return;
  Impl& w = *impl_;
  const std::vector<Json> all =
      w.exchange(cat("agree/", ++w.rounds), Json{{"ok", ok}, {"facts", facts_json(facts)}}, what, {});
  if (!ok) return;  // the caller rethrows its own error
  std::string names;
  std::vector<Json> all_facts;
  for (int64_t r = 0; r < size_; ++r) {
    const bool rank_ok = all[r].is_object() && all[r].value("ok", false);
    if (!rank_ok) names += cat(names.empty() ? "" : ", ", r);
    else all_facts.push_back(all[r].value("facts", Json::object()));
  }
  if (!names.empty())
    throw JobStopped(cat("rank ", names, " failed during ", what, " (its own message says why); rank ", rank_, " stops too"));
  if (const std::string d = differences(all_facts); !d.empty()) fail("the ranks disagree at ", what, "; ", d);
}

void World::set_step(int64_t step) { impl_->step.store(step); }

void World::fail_job(std::exception_ptr error) {
  Impl& w = *impl_;
  if (!distributed()) std::rethrow_exception(error);
  try {
    std::rethrow_exception(error);
  } catch (const JobStopped& e) {  // a consequence: the cause is someone else's
    w.publish("stopped", e.what());
  } catch (const Error& e) {  // this rank's own, stated failure (bad input, a diverged loss, ...)
    w.publish("failed", e.what());
  } catch (const CollectiveError& e) {
    w.broken = true;
    // Maybe because another rank went away or failed: if so, say which.
    const std::string why = w.diagnose();
    if (!why.empty()) {
      w.publish("stopped", why);
      throw JobStopped(cat("rank ", rank_, " stops: ", why));
    }
    w.publish("failed", e.what());
  } catch (const std::exception& e) {
    w.publish("failed", one_line(e));
  }
  std::rethrow_exception(error);
}

namespace {

class NoReducer final : public GradientReducer {
 public:
  void begin_micro_step(bool) override {}
  void before_backward() override {}
};

class C10dReducer final : public GradientReducer {
 public:
  C10dReducer(const std::vector<at::Tensor>& params, const c10::intrusive_ptr<c10d::ProcessGroup>& group,
              int64_t bucket_bytes) {
    // First buckets in reverse registration order, as backward produces the gradients (the last
    // layers' first); from the second step on, the order they were seen ready (rebuild_buckets).
    std::vector<int64_t> order;
    for (int64_t i = int64_t(params.size()) - 1; i >= 0; --i) order.push_back(i);
    const std::vector<at::Tensor> reversed(params.rbegin(), params.rend());
    const auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
        reversed, {size_t(1) << 20, size_t(bucket_bytes)}, std::vector<bool>(params.size(), false), order);
    std::unordered_map<size_t, std::string> names;
    std::vector<int64_t> caps(limits.begin(), limits.end());
    reducer_ = std::make_unique<c10d::Reducer>(params, buckets, group, std::vector<bool>(params.size(), false),
                                               bucket_bytes, /*find_unused_parameters=*/false,
                                               /*gradient_as_bucket_view=*/false, names,
                                               /*first_bucket_bytes_cap=*/int64_t(1) << 20,
                                               /*skip_all_reduce_unused_params=*/false,
                                               /*use_python_reducer=*/false, caps);
  }
  ~C10dReducer() override {
    // ~Reducer may throw (removing its autograd hooks); a destructor here must not.
    c10d::Reducer* reducer = reducer_.release();
    try {
      delete reducer;
    } catch (...) {
    }
  }
  void begin_micro_step(bool last) override {
    last_ = last;
    if (!last) return;
    reducer_->prepare_for_forward();
    // As DistributedDataParallel's forward: once, after the first step, re-buckets by the order
    // gradients became ready (a collective, taken by every rank at this same point). It also
    // checks that the previous step's reduction finished, which fails in one line when some
    // parameter received no gradient, instead of letting the ranks drift apart.
    try {
      reducer_->rebuild_buckets();
    } catch (const std::exception& e) {
      throw CollectiveError(one_line(e));
    }
  }
  void before_backward() override {
    if (last_) reducer_->prepare_for_backward({});
  }

 private:
  std::unique_ptr<c10d::Reducer> reducer_;
  bool last_ = true;
};

}  // namespace

std::unique_ptr<GradientReducer> Group::gradient_reducer(const std::vector<at::Tensor>& params, int64_t bucket_bytes) {
  if (size() == 1) return std::make_unique<NoReducer>();
  return std::make_unique<C10dReducer>(params, impl_->pg, bucket_bytes);
}

namespace {

c10::intrusive_ptr<c10d::ProcessGroup> make_process_group(const Backend& w, const c10::intrusive_ptr<c10d::Store>& store,
                                                          int64_t rank, int64_t size) {
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, int(rank), int(size));
  if (w.name == "gloo") {
    auto options = c10d::ProcessGroupGloo::Options::create(w.timeout);
    options->devices.push_back(w.master_addr == "127.0.0.1" || w.master_addr == "localhost"
                                   ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                   : c10d::ProcessGroupGloo::createDefaultDevice());
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, int(rank), int(size), options);
    group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::GLOO, gloo);
    group->setDefaultBackend(c10d::ProcessGroup::GLOO);
  } else if (w.name == "nccl") {
    // NCCL binds the calling thread's current device: this rank's GPU (LOCAL_RANK).
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->setDevice(w.device);
    auto nccl = make_nccl_backend(store, int(rank), int(size), w.timeout);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::NCCL, nccl);
    group->setDefaultBackend(c10d::ProcessGroup::NCCL);
    // NCCL's watchdog says why it ends a hung collective in an error-level log line before it
    // aborts the process: with NCCL, those lines pass (cli/app.cpp keeps only fatal ones).
    if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = std::min<int>(FLAGS_caffe2_log_level, 2);
  } else {
    fail("train.backend: unknown process-group backend '", w.name, "'");
  }
  return group;
}

}  // namespace

}  // namespace depthkit
