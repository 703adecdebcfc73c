#include "depthkit/util/process.h"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "depthkit/util/error.h"

namespace depthkit {

namespace {
pid_t g_child = 0;
volatile sig_atomic_t g_interrupted = 0;
void pass_on(int sig) {
  g_interrupted = 1;
  if (g_child > 0) kill(g_child, sig);
}
}  // namespace

std::string depthkit_program() {
  if (const char* program = std::getenv("DEPTHKIT_PROGRAM"); program && *program) return program;
  return "/proc/self/exe";  // the very file this process runs, even if its path was replaced since
}

ChildResult run_program(const std::vector<std::string>& args, const std::vector<std::pair<std::string, std::string>>& env) {
  if (args.empty()) fail("run_program: no program given");
  std::vector<std::string> all = args;
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) fail("cannot start ", args[0]);
  if (pid == 0) {
    for (const auto& [name, value] : env) setenv(name.c_str(), value.c_str(), 1);
    dup2(2, 1);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "depthkit: error: cannot run %s\n", argv[0]);
    _exit(127);
  }
  g_child = pid;
  g_interrupted = 0;
  auto old_int = std::signal(SIGINT, pass_on);
  auto old_term = std::signal(SIGTERM, pass_on);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  g_child = 0;
  std::signal(SIGINT, old_int);
  std::signal(SIGTERM, old_term);
  return {WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status), g_interrupted != 0};
}

}  // namespace depthkit
