// The `depthkit` subcommands. Each add_* registers one subcommand on the app and, when that
// subcommand is chosen, stores in `action` what to run after parsing.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>

#include "depthkit/util/numbers.h"

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

// Every subcommand above, on `app`: the program's option table (the fuzz tests walk it).
void add_commands(CLI::App& app, Action& action);

// Numeric options, parsed in one place (util/numbers.h): the whole value, range checked; a
// refusal names the option in one line (exit 2). The help shows the type and range
// ("--nproc INT in [1, 1024]"), which is also how the fuzz tests learn them.
CLI::Option* add_number(CLI::App* cmd, const std::string& name, int64_t& target, int64_t lo, int64_t hi,
                        const std::string& help);
CLI::Option* add_number(CLI::App* cmd, const std::string& name, int& target, int lo, int hi, const std::string& help);
CLI::Option* add_number(CLI::App* cmd, const std::string& name, uint64_t& target, uint64_t lo, uint64_t hi,
                        const std::string& help);
CLI::Option* add_number(CLI::App* cmd, const std::string& name, double& target, double lo, double hi,
                        const std::string& help, Bound lo_bound = Bound::closed, Bound hi_bound = Bound::closed);

// --set section.key=value, repeatable.
inline CLI::Option* add_set_option(CLI::App* cmd, std::vector<std::string>& sets) {
  return cmd->add_option("--set", sets, "override a config key: section.key=value (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

}  // namespace depthkit::cli
