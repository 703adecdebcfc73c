// A progress bar on stderr: count, rate (e.g. tokens/s), ETA and a free-form status.
// On a terminal it redraws one line; otherwise (logs, CI) it prints a line every few seconds.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace depthkit {

class Progress {
 public:
  // total: units of work (steps, documents); rate_unit names what `rate_amount` counts.
  Progress(std::string label, int64_t total, std::string rate_unit);
  // done: units finished so far; rate_amount: cumulative amount for the rate (e.g. tokens).
  void update(int64_t done, double rate_amount, const std::string& status = "");
  void finish(const std::string& status = "");
  static bool enabled();
  static void set_enabled(bool on);

 private:
  void draw(bool final_line);
  std::string label_, rate_unit_, status_;
  int64_t total_, done_ = 0;
  double start_amount_ = -1, amount_ = 0;
  int64_t start_done_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_;
  bool tty_;
};

std::string format_duration(double seconds);
std::string format_count(double x);  // 12.3k, 4.56M

}  // namespace depthkit
