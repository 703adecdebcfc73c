// depthkit's command line: parses argv, runs the chosen subcommand, prints any error as one line
// on stderr and returns the exit code (0 success, 1 failed command, 2 bad usage).
#pragma once

namespace depthkit::cli {

int run(int argc, char** argv);

}  // namespace depthkit::cli
