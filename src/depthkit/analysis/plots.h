// Figures: the C++ commands write their numbers as JSON, then render each PNG with the Python
// package in python/depthkit_plots (matplotlib, installed by scripts/setup):
//   <python> -m depthkit_plots FIGURE DATA.json OUT.png
// The interpreter is $DEPTHKIT_PYTHON or the one the build was configured with; the package is
// found in $DEPTHKIT_PLOTS_PATH or the source tree the program was built from.
#pragma once
#include <filesystem>
#include <string>

namespace depthkit {

// Renders `figure` (curves, maps, cka, rescue, gates, scaling) from `data` into `png`, written
// atomically. Throws, naming the PNG, if the renderer fails.
void render_plot(const std::string& figure, const std::filesystem::path& data, const std::filesystem::path& png);

}  // namespace depthkit
