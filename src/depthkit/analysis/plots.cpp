#include "depthkit/analysis/plots.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <vector>

#include "depthkit/util/error.h"

#ifndef DEPTHKIT_PYTHON_EXE
#define DEPTHKIT_PYTHON_EXE "python3"
#endif
#ifndef DEPTHKIT_PLOTS_DIR
#define DEPTHKIT_PLOTS_DIR ""
#endif

namespace depthkit {

void render_plot(const std::string& figure, const std::filesystem::path& data, const std::filesystem::path& png) {
  const char* env_python = std::getenv("DEPTHKIT_PYTHON");
  const char* env_path = std::getenv("DEPTHKIT_PLOTS_PATH");
  const std::string python = env_python && *env_python ? env_python : DEPTHKIT_PYTHON_EXE;
  std::string path = env_path && *env_path ? env_path : DEPTHKIT_PLOTS_DIR;
  if (const char* old = std::getenv("PYTHONPATH"); old && *old) path += std::string(":") + old;
  std::vector<std::string> args = {python, "-m", "depthkit_plots", figure, data.string(), png.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) fail("plot ", png.string(), ": cannot start ", python);
  if (pid == 0) {
    setenv("PYTHONPATH", path.c_str(), 1);
    setenv("MPLBACKEND", "Agg", 1);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "depthkit: error: cannot run %s (set DEPTHKIT_PYTHON)\n", argv[0]);
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail("plot ", png.string(), " not written: ", python, " -m depthkit_plots ", figure, " failed (status ",
         WIFEXITED(status) ? WEXITSTATUS(status) : -1, "; its message is above)");
}

}  // namespace depthkit
