// The depthkit command line as a function, so that tests can run commands in-process (a forked
// child per case in the fuzz tests) exactly as the program runs them.
#include "depthkit/cli/app.h"

#include <c10/util/Logging.h>

#include <cstdio>
#include <cstdlib>

#include "depthkit/cli/commands.h"
#include "depthkit/dist/launch.h"
#include "depthkit/util/error.h"

namespace depthkit::cli {

namespace {

// An option given an empty value ("--seed ''", "--kinds ''") is refused: it would otherwise read as
// 0 or the default, or be ignored. The name of the first such option, or "".
std::string option_given_empty(const CLI::App& cmd) {
  for (const CLI::Option* o : cmd.get_options()) {
    if (o->count() == 0 || o->get_expected_max() == 0) continue;  // not given, or a flag
    for (const std::string& value : o->results())
      if (value.empty()) return o->get_name();
  }
  for (const CLI::App* sub : cmd.get_subcommands())
    if (std::string name = option_given_empty(*sub); !name.empty()) return name;
  return "";
}

}  // namespace

void add_commands(CLI::App& app, Action& action) {
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
  add_plan(app, action);
}

int run(int argc, char** argv) {
  // A failed check inside LibTorch (an allocation that fails, for one) must throw, so that the
  // boundary below reports it in one line; with this flag set it aborts the process instead.
  FLAGS_caffe2_use_fatal_for_enforce = false;
  adopt_launcher_report_pipe();  // a rank of `train --nproc`: its errors go to the launcher
  // c10d and Gloo log socket retries, timeouts and failed connections as errors, with stack
  // traces, on stderr; depthkit reports a failed rendezvous or collective itself, in one line
  // that names the rank or variable at fault. Only fatal messages pass, unless
  // TORCH_CPP_LOG_LEVEL says otherwise.
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 3;
  CLI::App app{"depthkit: Transformer residual pathways that retrieve across depth"};
  app.require_subcommand(1);
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return std::string("depthkit: error: ") + printable(e.what()) + " (see --help)\n";
  });
  Action action;
  add_commands(app, action);
  auto is_command = [&](const std::string& name) {
    for (const auto* sub : app.get_subcommands([](const CLI::App*) { return true; }))
      if (sub->get_name() == name) return true;
    return false;
  };
  if (argc > 1 && argv[1][0] != '-' && !is_command(argv[1])) {
    std::fprintf(stderr, "depthkit: error: unknown command '%s' (see --help)\n", printable(argv[1]).c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and friends print and succeed; any other parse error is bad usage: exit 2.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (const std::string name = option_given_empty(app); !name.empty()) {
    std::fprintf(stderr, "depthkit: error: %s: an empty value (give one, or leave the option out) (see --help)\n",
                 name.c_str());
    return 2;
  }
  try {
    return action ? action() : 0;
  } catch (const std::exception& e) {
    const std::string line = error_line(e);
    // A rank of `train --nproc` hands its line to the launcher, which speaks for the job.
    if (!report_to_launcher(e, line)) std::fprintf(stderr, "depthkit: error: %s\n", line.c_str());
    return 1;
  }
}

}  // namespace depthkit::cli
