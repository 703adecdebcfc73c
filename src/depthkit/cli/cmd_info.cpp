// depthkit info: build and runtime facts (versions, threads, CUDA).
#include <ATen/Parallel.h>
#include <torch/version.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "depthkit/cli/commands.h"
#ifdef DEPTHKIT_WITH_CUDA
#include "depthkit/util/cuda/device_info.h"
#endif

namespace depthkit::cli {

void add_info(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("info", "print build and runtime information");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "print JSON");
  cmd->callback([&action, json] {
    action = [json] {
      nlohmann::json j = {{"depthkit", "0.1.0"}, {"torch", TORCH_VERSION}, {"threads", at::get_num_threads()}};
#ifdef DEPTHKIT_WITH_CUDA
      j["cuda_sources"] = true;
      j["cuda_devices"] = depthkit::cuda::device_count();
#else
      j["cuda_sources"] = false;
#endif
      if (*json) std::printf("%s\n", j.dump().c_str());
      else
        for (auto& [k, v] : j.items()) std::printf("%-13s %s\n", k.c_str(), v.dump().c_str());
      return 0;
    };
  });
}

}  // namespace depthkit::cli
