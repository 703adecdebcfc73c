// The `depthkit` subcommands. Each add_* registers one subcommand on the app and, when that
// subcommand is chosen, stores in `action` what to run after parsing.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

#include "depthkit/cli/options.h"

namespace depthkit::cli {

using Action = std::function<int()>;

void add_data(CLI::App& app, Action& action);
void add_data_encode(CLI::App* data, Action& action);  // `data encode`, beside `data prepare`
void add_train(CLI::App& app, Action& action);
void add_eval(CLI::App& app, Action& action);
void add_params(CLI::App& app, Action& action);
void add_bench(CLI::App& app, Action& action);
void add_info(CLI::App& app, Action& action);
void add_init(CLI::App& app, Action& action);
void add_forward(CLI::App& app, Action& action);
void add_generate(CLI::App& app, Action& action);
void add_compare(CLI::App& app, Action& action);
void add_analyze(CLI::App& app, Action& action);
void add_cost(CLI::App& app, Action& action);
void add_scaling(CLI::App& app, Action& action);
void add_plan(CLI::App& app, Action& action);

// Every subcommand above, on `app`: the program's option table (the fuzz tests walk it).
void add_commands(CLI::App& app, Action& action);

}  // namespace depthkit::cli
