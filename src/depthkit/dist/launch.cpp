#include "depthkit/dist/launch.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <set>
#include <thread>

#include "depthkit/dist/world.h"
#include "depthkit/util/error.h"
#include "depthkit/util/process.h"

extern "C" char** environ;

namespace depthkit {

namespace {

constexpr int kMaxRanks = 1024;
// The environment variable that gives a launched rank the pipe to its launcher (report_to_launcher).
constexpr const char* kReportFd = "DEPTHKIT_REPORT_FD";
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

// How one rank ended, and what it reported.
struct RankEnd {
  int status = 0;              // as waitpid gives it
  bool killed_by_us = false;   // ended by the launcher after the grace period
  std::string kind, line;      // its report: "cause" or "consequence", and the one line
};

// Everything a rank wrote to its report pipe (the write ends are closed: it has ended).
std::string drain(int fd) {
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) out.append(buf, size_t(n));
    else if (n < 0 && errno == EINTR) continue;
    else return out;
  }
}

// The job's one line from how its ranks ended: a rank ended by a signal the launcher did not send
// (killed, crashed) is the cause before anything the others say about it; then the first rank's
// own failure; then the first rank's account of another's (a consequence); then a bare status.
std::string job_error(const std::vector<RankEnd>& ends) {
  for (size_t r = 0; r < ends.size(); ++r)
    if (WIFSIGNALED(ends[r].status) && !ends[r].killed_by_us) {
      const int sig = WTERMSIG(ends[r].status);
      const char* abbrev = sigabbrev_np(sig);
      return cat("rank ", r, " was ended by signal ", sig, abbrev ? cat(" (SIG", abbrev, ")") : std::string(),
                 ": killed or crashed; the other ranks stopped");
    }
  for (const char* kind : {"cause", "consequence"})
    for (const RankEnd& e : ends)
      if (e.kind == kind) return e.line;
  for (size_t r = 0; r < ends.size(); ++r)
    if (exit_status(ends[r].status) != 0)
      return cat("rank ", r, WIFSIGNALED(ends[r].status) ? " was ended after the others failed" :
                                 cat(" exited with status ", WEXITSTATUS(ends[r].status)).c_str());
  return "";
}

}  // namespace

bool report_to_launcher(const std::exception& error, const std::string& line) {
  const char* fd_text = std::getenv(kReportFd);
  if (!fd_text || !*fd_text) return false;
  char* end = nullptr;
  const long fd = std::strtol(fd_text, &end, 10);
  if (*end != '\0' || fd < 3 || fd > INT32_MAX) return false;
  // A pipe holds 64 KiB before a write blocks: the line is cut well below.
  std::string report = cat(dynamic_cast<const JobStopped*>(&error) ? "consequence " : "cause ", line.substr(0, 16384), "\n");
  size_t done = 0;
  while (done < report.size()) {
    const ssize_t n = ::write(int(fd), report.data() + done, report.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;  // the launcher is gone: say it here
    done += size_t(n);
  }
  return true;
}

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

  // Each rank reports the error that ends it through its own pipe, so that the job prints one line
  // (job_error) and not one per rank.
  std::vector<std::array<int, 2>> reports(nproc);
  auto close_reports = [&] {
    for (auto& p : reports)
      for (int& fd : p)
        if (fd >= 0) ::close(fd), fd = -1;
  };
  for (auto& p : reports) {
    p = {-1, -1};
    if (::pipe2(p.data(), O_CLOEXEC) != 0) {
      const int err = errno;
      close_reports();
      fail("cannot create the ranks' report pipes: ", std::strerror(err));
    }
  }

  // Every rank's argv and environment are made before the first fork: between fork and exec a
  // child of this multi-threaded process (the store's server thread) may only call async-signal-
  // safe functions.
  std::vector<std::string> args = argv;
  const std::string program = depthkit_program();
  std::vector<char*> cargv;
  for (auto& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const std::set<std::string> ours = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", kReportFd};
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
                                 cat("MASTER_PORT=", port), std::string("TORCHELASTIC_USE_AGENT_STORE=True"),
                                 cat(kReportFd, "=", reports[r][1])})
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
    close_reports();
  };
  const pid_t launcher = ::getpid();
  for (int64_t r = 0; r < nproc; ++r) {
    const pid_t pid = fork();
    if (pid < 0) {
      for (int64_t q = 0; q < r; ++q) kill(g_ranks[q], SIGKILL);
      for (int64_t q = 0; q < r; ++q) waitpid(g_ranks[q], nullptr, 0);
      restore();
      fail("cannot start rank ", r, " (fork failed)");
    }
    if (pid == 0) {
      // The rank keeps its report pipe across exec, and is sent SIGTERM (checkpoint and stop) when
      // its launcher dies, kill -9 included: no rank trains on unsupervised. A launcher that died
      // before this line leaves the rank adopted already: then it does not start at all.
      ::fcntl(reports[r][1], F_SETFD, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) _exit(1);
      execve(program.c_str(), cargv.data(), cenvs[r].data());
      static const char msg[] = "depthkit: error: cannot run the depthkit program for a rank\n";
      (void)!write(2, msg, sizeof msg - 1);
      _exit(127);
    }
    g_ranks[r] = pid;
    g_rank_count.store(int(r + 1));
  }
  for (auto& p : reports) ::close(p[1]), p[1] = -1;  // the ranks hold the write ends

  // Wait for every rank. After the first failure the others get grace_s to notice and stop.
  std::vector<RankEnd> ends(nproc);
  std::vector<bool> killed(nproc, false);
  bool failed = false;
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
          if (g_ranks[r] > 0 && !killed[r]) kill(g_ranks[r], SIGKILL), killed[r] = true;
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
    ends[rank].status = status;
    ends[rank].killed_by_us = killed[rank] || g_signals > 1;
    if (exit_status(status) != 0 && !failed) {
      failed = true;
      deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(grace_s * 1000));
    }
  }
  for (int64_t r = 0; r < nproc; ++r) {
    const std::string report = drain(reports[r][0]);
    const size_t space = report.find(' ');
    if (space == std::string::npos) continue;
    ends[r].kind = report.substr(0, space);
    ends[r].line = report.substr(space + 1, report.find('\n') - space - 1);
  }
  const bool forced = g_signals > 1;  // a second Ctrl-C: the user ended every rank
  restore();
  if (!failed) return 0;
  // Ranks that stopped as asked (130, 143: a signal, --stop-after, their launcher's death) after
  // their checkpoint, with no error: the job was interrupted, not failed.
  bool stopped = true;
  int stop_status = 0;
  for (const RankEnd& e : ends) {
    const int s = exit_status(e.status);
    stopped &= e.kind.empty() && !WIFSIGNALED(e.status) && (s == 0 || s == 128 + SIGINT || s == 128 + SIGTERM);
    if (s != 0 && stop_status == 0) stop_status = s;
  }
  if (forced) return 128 + SIGINT;
  if (stopped) return stop_status;
  std::fprintf(stderr, "depthkit: error: %s\n", job_error(ends).c_str());
  return 1;
}

}  // namespace depthkit
