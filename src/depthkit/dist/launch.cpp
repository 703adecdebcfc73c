#include "depthkit/dist/launch.h"

#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <set>
#include <optional>
#include <cerrno>
#include <thread>

#include "depthkit/util/error.h"

extern "C" char** environ;

namespace depthkit {

namespace {

constexpr int kMaxRanks = 1024;
pid_t g_ranks[kMaxRanks];
std::atomic<int> g_rank_count{0};
volatile sig_atomic_t g_signals = 0;

// The first SIGINT/SIGTERM is passed on (each rank checkpoints and stops at the same step); a
// second one, for a job that does not stop (ranks blocked in a rendezvous or a hung collective),
// ends every rank at once.
void pass_on(int sig) {
  const int count = g_signals + 1;
  g_signals = count;
  const int send = count > 1 ? SIGKILL : sig;
  for (int i = 0; i < g_rank_count.load(); ++i)
    if (g_ranks[i] > 0) kill(g_ranks[i], send);
}

int exit_status(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

std::string describe(int64_t rank, int status) {
  if (WIFSIGNALED(status)) return cat("rank ", rank, " was ended by signal ", WTERMSIG(status));
  return cat("rank ", rank, " exited with status ", WEXITSTATUS(status));
}

}  // namespace

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  size_t start = 0;
  for (size_t i = 0; i < all.size(); ++i)
    if (all[i] == '\0') args.push_back(all.substr(start, i - start)), start = i + 1;
  return args;
}

int launch_local_ranks(int64_t nproc, const std::vector<std::string>& argv, double grace_s) {
  if (nproc < 1 || nproc > kMaxRanks) fail("--nproc must be in [1, ", kMaxRanks, "], got ", nproc);
  std::signal(SIGPIPE, SIG_IGN);  // a rank that is gone must not take its store's host with it
  // The job's store, on a port the kernel picks: no clash with another job on this machine.
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.waitWorkers = false;
  c10d::TCPStore store("127.0.0.1", opts);
  const std::string port = std::to_string(store.getPort());
  // Each rank takes its share of the cores unless told otherwise (torchrun sets 1).
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string threads = std::to_string(std::max<int64_t>(1, int64_t(cores) / nproc));

  // Every rank's argv and environment are made before the first fork: between fork and exec a
  // child of this multi-threaded process (the store's server thread) may only call async-signal-
  // safe functions.
  std::vector<std::string> args = argv;
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const std::set<std::string> ours = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"};
  std::vector<std::string> inherited;
  bool has_threads = false;
  for (char** e = environ; *e; ++e) {
    const std::string var = *e, name = var.substr(0, var.find('='));
    if (ours.count(name)) continue;
    has_threads |= name == "OMP_NUM_THREADS";
    inherited.push_back(var);
  }
  std::vector<std::vector<std::string>> envs(nproc, inherited);
  std::vector<std::vector<char*>> cenvs(nproc);
  for (int64_t r = 0; r < nproc; ++r) {
    for (const std::string& v : {cat("RANK=", r), cat("LOCAL_RANK=", r), cat("WORLD_SIZE=", nproc),
                                 cat("LOCAL_WORLD_SIZE=", nproc), std::string("MASTER_ADDR=127.0.0.1"),
                                 cat("MASTER_PORT=", port), std::string("TORCHELASTIC_USE_AGENT_STORE=True")})
      envs[r].push_back(v);
    if (!has_threads) envs[r].push_back("OMP_NUM_THREADS=" + threads);
    for (auto& v : envs[r]) cenvs[r].push_back(v.data());
    cenvs[r].push_back(nullptr);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  g_signals = 0;
  auto old_int = std::signal(SIGINT, pass_on);
  auto old_term = std::signal(SIGTERM, pass_on);
  auto restore = [&] {
    g_rank_count.store(0);
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
  };
  for (int64_t r = 0; r < nproc; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      for (int64_t q = 0; q < r; ++q) kill(g_ranks[q], SIGKILL);
      for (int64_t q = 0; q < r; ++q) waitpid(g_ranks[q], nullptr, 0);
      restore();
      fail("cannot start rank ", r, " (fork failed)");
    }
    if (pid == 0) {
      execve("/proc/self/exe", cargv.data(), cenvs[r].data());
      static const char msg[] = "depthkit: error: cannot run /proc/self/exe for a rank\n";
      (void)!write(2, msg, sizeof msg - 1);
      _exit(127);
    }
    g_ranks[r] = pid;
    g_rank_count.store(int(r + 1));
  }

  // Wait for every rank. After the first failure the others get grace_s to notice and stop.
  int result = 0;
  int64_t running = nproc;
  std::optional<std::chrono::steady_clock::time_point> deadline;
  while (running > 0) {
    int status = 0;
    const pid_t pid = waitpid(-1, &status, deadline ? WNOHANG : 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pid == 0) {  // none ended: past the deadline, end the rest
      if (std::chrono::steady_clock::now() > *deadline) {
        for (int64_t r = 0; r < nproc; ++r)
          if (g_ranks[r] > 0) kill(g_ranks[r], SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    int64_t rank = -1;
    for (int64_t r = 0; r < nproc; ++r)
      if (g_ranks[r] == pid) rank = r;
    if (rank < 0) continue;
    g_ranks[rank] = 0;
    --running;
    if (exit_status(status) != 0 && result == 0) {
      result = exit_status(status);
      // An interrupted job (130, 143) stops by itself; a failed one is explained by its ranks.
      if (WIFSIGNALED(status)) std::fprintf(stderr, "depthkit: %s\n", describe(rank, status).c_str());
      deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(grace_s * 1000));
    }
  }
  restore();
  return result;
}

}  // namespace depthkit
