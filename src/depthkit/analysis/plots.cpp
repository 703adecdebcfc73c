#include "depthkit/analysis/plots.h"

#include <cstdlib>

#include "depthkit/util/error.h"
#include "depthkit/util/process.h"

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
  const int status = run_program({python, "-m", "depthkit_plots", figure, data.string(), png.string()},
                                  {{"PYTHONPATH", path}, {"MPLBACKEND", "Agg"}}).status;
  if (status != 0)
    fail("plot ", png.string(), " not written: ", python, " -m depthkit_plots ", figure, " failed (status ", status,
         "; its message is above)");
}

}  // namespace depthkit
