// The `depthkit` subcommands. Each add_* registers one subcommand on the app and, when that
// subcommand is chosen, stores in `action` what to run after parsing.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

namespace depthkit::cli {

using Action = std::function<int()>;

void add_data(CLI::App& app, Action& action);
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

// --set section.key=value, repeatable.
inline CLI::Option* add_set_option(CLI::App* cmd, std::vector<std::string>& sets) {
  return cmd->add_option("--set", sets, "override a config key: section.key=value (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

}  // namespace depthkit::cli
