// Options that several commands take, each defined once: numbers (parsed whole and range
// checked), and the configuration a command builds from (--config and its --set overrides).
#pragma once
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "depthkit/util/numbers.h"

namespace depthkit::cli {

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

// --set section.key=value, repeatable (applied in the order given).
CLI::Option* add_set_option(CLI::App* cmd, std::vector<std::string>& sets);

// What a command that builds from a config is given: the TOML file, its overrides, and whether
// to print JSON. A command's own arguments extend it (struct Args : ConfigArgs).
struct ConfigArgs {
  std::string config;             // --config
  std::vector<std::string> sets;  // --set, in order
  bool json = false;              // --json, for the commands that take it (each adds it: its help and place vary)
};

// Whether --config must be given. `optional`: the command says itself when it needs one (train
// --resume reads the run's own; bench --ops needs none).
enum class ConfigFile { required, optional };

// --config FILE and --set section.key=value (repeatable), into `args`.
void add_config_options(CLI::App* cmd, ConfigArgs& args, ConfigFile file);

}  // namespace depthkit::cli
