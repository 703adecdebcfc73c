#include "depthkit/dist/launch.h"

#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
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
#include "depthkit/util/numbers.h"
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
volatile sig_atomic_t g_forwarded = 0;  // the first signal passed on to the ranks
int g_report_fd = -1;  // in a rank: the pipe to its launcher (adopt_launcher_report_pipe)

// The first SIGINT/SIGTERM is passed on (each rank checkpoints and stops at the same step); a
// second one, for a job that does not stop (ranks blocked in a rendezvous or a hung collective),
// ends every rank at once.
void pass_on(int sig) {
  const int count = g_signals + 1;
  g_signals = count;
  if (count == 1) g_forwarded = sig;
  const int send = count > 1 ? SIGKILL : sig;
  for (int i = 0; i < g_rank_count.load(); ++i)
    if (g_ranks[i] > 0) kill(g_ranks[i], send);
}

int exit_status(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

// How one rank ended, and what it reported.
struct RankEnd {
  int status = 0;              // as waitpid gives it
  bool killed_by_us = false;   // ended by a signal the launcher sent
  std::string kind, line;      // its report: "cause" or "consequence", and the one line
};

// What a rank wrote to its report pipe (non-blocking: read after the rank has ended).
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

void adopt_launcher_report_pipe() {
  const char* text = std::getenv(kReportFd);
  if (!text) return;
  const std::string given = text;
  ::unsetenv(kReportFd);  // for this process only: nothing it starts inherits the pipe
  try {
    g_report_fd = int(parse_int(given, 3, INT32_MAX, kReportFd));
  } catch (const Error&) {
    return;
  }
  if (::fcntl(g_report_fd, F_SETFD, FD_CLOEXEC) != 0) g_report_fd = -1;
  std::signal(SIGPIPE, SIG_IGN);  // a launcher gone: the write fails, and the line is printed here
}

bool report_to_launcher(const std::exception& error, const std::string& line) {
  if (g_report_fd < 0) return false;
  // One write of at most PIPE_BUF bytes into a pipe only this process writes to: it never blocks,
  // whatever the pipe's capacity, and arrives whole.
  std::string report = cat(dynamic_cast<const JobStopped*>(&error) ? "consequence " : "cause ", line);
  report.resize(std::min<size_t>(report.size(), PIPE_BUF - 1));
  report += "\n";
  ssize_t n;
  do n = ::write(g_report_fd, report.data(), report.size());
  while (n < 0 && errno == EINTR);
  return n == ssize_t(report.size());  // else the launcher is gone: say it here
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

namespace {

// Waits for the nproc ranks of g_ranks, then reads each one's report from its pipe (reports, the
// read ends). After the first failure (`failed` is set) the others get grace_s to notice and stop,
// then are killed.
std::vector<RankEnd> wait_for_ranks(int64_t nproc, const std::vector<int>& reports, double grace_s, bool& failed) {
  std::vector<RankEnd> ends(nproc);
  std::vector<bool> killed(nproc, false);
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
    // Ended by the launcher: after the grace period, by a second Ctrl-C, or by the signal it passed
    // on, arriving before the rank's own handler was installed.
    ends[rank].killed_by_us = killed[rank] || g_signals > 1 ||
                              (WIFSIGNALED(status) && g_forwarded != 0 && WTERMSIG(status) == g_forwarded);
    if (exit_status(status) != 0 && !failed) {
      failed = true;
      deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(int64_t(grace_s * 1000));
    }
  }
  for (int64_t r = 0; r < nproc; ++r) {
    const std::string report = drain(reports[r]);
    const size_t space = report.find(' ');
    if (space == std::string::npos) continue;
    ends[r].kind = report.substr(0, space);
    ends[r].line = report.substr(space + 1, report.find('\n') - space - 1);
  }
  return ends;
}

}  // namespace

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

  // Every rank's argv and environment are made before its fork: between fork and exec a child of
  // this multi-threaded process (the store's server thread) may only call async-signal-safe
  // functions.
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
  // Each rank reports the error that ends it through its own pipe (the read ends, kept here), so
  // that the job prints one line (job_error) and not one per rank.
  std::vector<int> reports(nproc, -1);
  std::fflush(stdout);
  std::fflush(stderr);
  g_signals = 0;
  auto old_int = std::signal(SIGINT, pass_on);
  auto old_term = std::signal(SIGTERM, pass_on);
  auto restore = [&] {
    g_rank_count.store(0);
    std::signal(SIGINT, old_int);
    std::signal(SIGTERM, old_term);
    for (int& fd : reports)
      if (fd >= 0) ::close(fd), fd = -1;
  };
  // SIGINT and SIGTERM wait while a rank is forked: the child must not run pass_on (it would
  // forward the signal to the ranks started before it), and the parent forwards to a rank only
  // once its pid is recorded.
  sigset_t stop_signals, old_mask;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  const pid_t launcher = ::getpid();
  for (int64_t r = 0; r < nproc; ++r) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) {
      const int err = errno;
      for (int64_t q = 0; q < r; ++q) kill(g_ranks[q], SIGKILL), waitpid(g_ranks[q], nullptr, 0);
      restore();
      fail("cannot create rank ", r, "'s report pipe: ", std::strerror(err));
    }
    reports[r] = pipe_fds[0];
    ::fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);  // drained after the rank ends; nothing else may hold it up
    std::vector<std::string> env = inherited;
    for (const std::string& v : {cat("RANK=", r), cat("LOCAL_RANK=", r), cat("WORLD_SIZE=", nproc),
                                 cat("LOCAL_WORLD_SIZE=", nproc), std::string("MASTER_ADDR=127.0.0.1"),
                                 cat("MASTER_PORT=", port), std::string("TORCHELASTIC_USE_AGENT_STORE=True"),
                                 cat(kReportFd, "=", pipe_fds[1])})
      env.push_back(v);
    if (!has_threads) env.push_back("OMP_NUM_THREADS=" + threads);
    std::vector<char*> cenv;
    for (auto& v : env) cenv.push_back(v.data());
    cenv.push_back(nullptr);
    pthread_sigmask(SIG_BLOCK, &stop_signals, &old_mask);
    const pid_t pid = fork();
    if (pid == 0) {
      // The rank keeps its report pipe across exec, and is sent SIGTERM (checkpoint and stop) when
      // its launcher dies, kill -9 included: no rank trains on unsupervised. A launcher that died
      // before this line leaves the rank adopted already: then it does not start at all.
      std::signal(SIGINT, SIG_DFL);
      std::signal(SIGTERM, SIG_DFL);
      pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
      ::fcntl(pipe_fds[1], F_SETFD, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) _exit(1);
      execve(program.c_str(), cargv.data(), cenv.data());
      static const char msg[] = "depthkit: error: cannot run the depthkit program for a rank\n";
      (void)!write(2, msg, sizeof msg - 1);
      _exit(127);
    }
    ::close(pipe_fds[1]);  // the rank holds the write end
    if (pid > 0) g_ranks[r] = pid, g_rank_count.store(int(r + 1));
    pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    if (pid < 0) {
      for (int64_t q = 0; q < r; ++q) kill(g_ranks[q], SIGKILL), waitpid(g_ranks[q], nullptr, 0);
      restore();
      fail("cannot start rank ", r, " (fork failed)");
    }
  }

  bool failed = false;
  std::vector<RankEnd> ends = wait_for_ranks(nproc, reports, grace_s, failed);
  const bool forced = g_signals > 1;  // a second Ctrl-C: the user ended every rank
  restore();
  if (!failed) return 0;
  // Ranks that stopped as asked (130, 143: a signal, --stop-after, their launcher's death) after
  // their checkpoint, with no error: the job was interrupted, not failed.
  bool stopped = true;
  int stop_status = 0;
  for (const RankEnd& e : ends) {
    const int s = exit_status(e.status);
    stopped &= e.kind.empty() && (!WIFSIGNALED(e.status) || e.killed_by_us) &&
               (s == 0 || s == 128 + SIGINT || s == 128 + SIGTERM);
    if (s != 0 && stop_status == 0) stop_status = s;
  }
  if (forced) return 128 + SIGINT;
  if (stopped) return stop_status;
  std::fprintf(stderr, "depthkit: error: %s\n", job_error(ends).c_str());
  return 1;
}

}  // namespace depthkit
