// Running another program and waiting for it (compare's training runs, the Python plots).
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace depthkit {

struct ChildResult {
  int status = 0;            // the exit status; 128 + the signal if a signal ended it
  bool interrupted = false;  // SIGINT or SIGTERM arrived while waiting (and was passed on)
};

// Runs argv[0] (looked up in PATH) with argv, with `env` set in its environment and its stdout on
// our stderr (so that our stdout stays for --json). SIGINT and SIGTERM that reach us meanwhile are
// passed to the child, which decides how to stop. Throws if the program cannot be started.
ChildResult run_program(const std::vector<std::string>& argv,
                        const std::vector<std::pair<std::string, std::string>>& env = {});

// The depthkit program that commands run again (compare's runs, train --nproc's ranks): this
// process's own executable, unless $DEPTHKIT_PROGRAM names another (a program that runs depthkit's
// commands in-process, as its fuzz tests do, is not depthkit itself).
std::string depthkit_program();

}  // namespace depthkit
