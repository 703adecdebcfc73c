// The options that several commands share (options.h).
#include "depthkit/cli/options.h"

#include <limits>

#include "depthkit/util/error.h"
#include "depthkit/util/numbers.h"

namespace depthkit::cli {

namespace {

// An option whose value `parse` turns into `target` when it is given; its Error becomes CLI11's
// ValidationError, which the command line reports as bad usage.
template <class T, class Parse>
CLI::Option* add_parsed(CLI::App* cmd, const std::string& name, T& target, const std::string& help,
                        const std::string& type, Parse parse) {
  return cmd
      ->add_option_function<std::string>(
          name,
          [&target, parse](const std::string& text) {
            try {
              target = parse(text);
            } catch (const Error& e) {
              throw CLI::ValidationError(e.what());
            }
          },
          help)
      ->type_name(type);
}

}  // namespace

CLI::Option* add_number(CLI::App* cmd, const std::string& name, int64_t& target, int64_t lo, int64_t hi,
                        const std::string& help) {
  return add_parsed(cmd, name, target, help, "INT " + range_text(lo, hi),
                    [=](const std::string& s) { return parse_int(s, lo, hi, name); });
}

CLI::Option* add_number(CLI::App* cmd, const std::string& name, int& target, int lo, int hi, const std::string& help) {
  return add_parsed(cmd, name, target, help, "INT " + range_text(int64_t(lo), int64_t(hi)),
                    [=](const std::string& s) { return int(parse_int(s, lo, hi, name)); });
}

CLI::Option* add_number(CLI::App* cmd, const std::string& name, uint64_t& target, uint64_t lo, uint64_t hi,
                        const std::string& help) {
  return add_parsed(cmd, name, target, help, "UINT " + range_text(lo, hi),
                    [=](const std::string& s) { return parse_uint(s, lo, hi, name); });
}

CLI::Option* add_number(CLI::App* cmd, const std::string& name, double& target, double lo, double hi,
                        const std::string& help, Bound lo_bound, Bound hi_bound) {
  return add_parsed(cmd, name, target, help,
                    "FLOAT " + range_text(lo, hi, std::numeric_limits<double>::infinity(), lo_bound, hi_bound),
                    [=](const std::string& s) { return parse_real(s, lo, hi, name, lo_bound, hi_bound); });
}

CLI::Option* add_set_option(CLI::App* cmd, std::vector<std::string>& sets) {
  return cmd->add_option("--set", sets, "override a config key: section.key=value (repeatable)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

void add_config_options(CLI::App* cmd, ConfigArgs& args, ConfigFile file) {
  CLI::Option* config = cmd->add_option("--config", args.config, "TOML config");
  if (file == ConfigFile::required) config->required();
  add_set_option(cmd, args.sets);
}

}  // namespace depthkit::cli
