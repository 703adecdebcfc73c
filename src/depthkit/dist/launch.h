// `depthkit train --nproc N`: the job's launcher for users without torchrun. It hosts the job's
// TCPStore (so that the store outlives any rank, as torchrun's agent does), starts N copies of
// this program with torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) and its own
// DEPTHKIT_REPORT_FD (the pipe a rank's error comes back through), and waits for them.
#pragma once
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

namespace depthkit {

// Runs `argv` (argv[0] is ignored: this program runs again) as ranks 0 … nproc − 1 on this
// machine. SIGINT and SIGTERM are passed on to every rank; a rank whose launcher dies (kill -9
// included) is sent SIGTERM, so it checkpoints and stops. When a rank fails, the others are given
// `grace_s` seconds to stop on their own (they notice within train.timeout_s), then killed.
// The job speaks once: ranks report the error that ends them to the launcher instead of printing
// it, and the launcher prints one line for the job (a rank killed or crashed, else the first
// rank's own failure, else its account of another's). Returns 0 when every rank succeeded, 130
// or 143 when an interrupted job stopped (with its checkpoint, unless a second Ctrl-C ended the
// ranks at once), else 1.
int launch_local_ranks(int64_t nproc, const std::vector<std::string>& argv, double grace_s);

// In a rank that launch_local_ranks started: hands the one line of the error that ends this
// process (tagged a cause, or a consequence when it is JobStopped) to the launcher and returns
// true. Returns false, and the caller prints the line, in any other process or when the launcher
// is gone.
bool report_to_launcher(const std::exception& error, const std::string& line);
// Called once at start-up: takes the report pipe launch_local_ranks gave this process (its
// DEPTHKIT_REPORT_FD, then removed from the environment and closed on exec), so that nothing this
// process starts inherits it.
void adopt_launcher_report_pipe();

// This process's command line, as the kernel has it (/proc/self/cmdline).
std::vector<std::string> own_command_line();

}  // namespace depthkit
