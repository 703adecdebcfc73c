// depthkit: train, compare and measure residual pathways that retrieve across depth.
#include <malloc.h>

#include <cstdio>

#include "depthkit/cli/commands.h"
#include "depthkit/util/error.h"

int main(int argc, char** argv) {
  // Tensors of a training step are freed and allocated again at every step. glibc serves large
  // blocks with fresh mmap pages, so every step would fault in and zero them again (measured:
  // more system than user time in `bench --ops`). Keep freed memory in the heap for reuse.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  CLI::App app{"depthkit: Transformer residual pathways that retrieve across depth"};
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("depthkit: error: ") + e.what() + " (see --help)\n";
  });
  depthkit::cli::Action action;
  depthkit::cli::add_data(app, action);
  depthkit::cli::add_train(app, action);
  depthkit::cli::add_eval(app, action);
  depthkit::cli::add_params(app, action);
  depthkit::cli::add_bench(app, action);
  depthkit::cli::add_info(app, action);
  depthkit::cli::add_init(app, action);
  depthkit::cli::add_forward(app, action);
  depthkit::cli::add_compare(app, action);
  depthkit::cli::add_analyze(app, action);
  depthkit::cli::add_cost(app, action);
  depthkit::cli::add_scaling(app, action);
  auto is_command = [&](const std::string& name) {
    for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == name) return true;
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !is_command(argv[1])) {
    std::fprintf(stderr, "depthkit: error: unknown command '%s' (see --help)\n", argv[1]);
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return action ? action() : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "depthkit: error: %s\n", depthkit::one_line(e).c_str());
    return 1;
  }
}
