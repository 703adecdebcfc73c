// The depthkit command line as a function, so that tests can run commands in-process (a forked
// child per case in the fuzz tests) exactly as the program runs them.
#include "depthkit/cli/app.h"

#include <c10/util/Logging.h>

#include <cstdio>
#include <cstdlib>

#include "depthkit/cli/commands.h"
#include "depthkit/util/error.h"

namespace depthkit::cli {

int run(int argc, char** argv) {
  // A failed check inside LibTorch (an allocation that fails, for one) must throw, so that the
  // boundary below reports it in one line; with this flag set it aborts the process instead.
  FLAGS_caffe2_use_fatal_for_enforce = false;
  // c10d logs its socket retries and timeouts as multi-line warnings on stderr; depthkit reports a
  // failed rendezvous or collective itself, in one line. TORCH_CPP_LOG_LEVEL, when set, decides.
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 2;  // errors only
  CLI::App app{"depthkit: Transformer residual pathways that retrieve across depth"};
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("depthkit: error: ") + e.what() + " (see --help)\n";
  });
  Action action;
  add_data(app, action);
  add_train(app, action);
  add_eval(app, action);
  add_params(app, action);
  add_bench(app, action);
  add_info(app, action);
  add_init(app, action);
  add_forward(app, action);
  add_generate(app, action);
  add_compare(app, action);
  add_analyze(app, action);
  add_cost(app, action);
  add_scaling(app, action);
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
    std::fprintf(stderr, "depthkit: error: %s\n", error_line(e).c_str());
    return 1;
  }
}

}  // namespace depthkit::cli
