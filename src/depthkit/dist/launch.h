// `depthkit train --nproc N`: the job's launcher for users without torchrun. It hosts the job's
// TCPStore (so that the store outlives any rank, as torchrun's agent does), starts N copies of
// this program with torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) and waits for them.
#pragma once
#include <string>
#include <vector>

namespace depthkit {

// Runs `argv` (argv[0] is ignored: this program runs again) as ranks 0 … nproc − 1 on this
// machine. SIGINT and SIGTERM are passed on to every rank. When a rank fails, the others are
// given `grace_s` seconds to stop on their own (they notice within train.timeout_s), then killed.
// Returns the job's exit status: 0 when every rank succeeded, else the first failed rank's.
int launch_local_ranks(int64_t nproc, const std::vector<std::string>& argv, double grace_s);

// This process's command line, as the kernel has it (/proc/self/cmdline).
std::vector<std::string> own_command_line();

}  // namespace depthkit
