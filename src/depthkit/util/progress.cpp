#include "depthkit/util/progress.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

namespace depthkit {

namespace {
bool g_enabled = true;
}

bool Progress::enabled() { return g_enabled; }
void Progress::set_enabled(bool on) { g_enabled = on; }

Progress::Progress(std::string label, int64_t total, std::string rate_unit)
    : label_(std::move(label)), rate_unit_(std::move(rate_unit)), total_(total),
      start_(std::chrono::steady_clock::now()), last_draw_(start_), tty_(isatty(2)) {}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "--";
  long t = std::lround(s);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, (t / 60) % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%lds", t);
  return buf;
}

std::string format_count(double x) {
  char buf[32];
  if (x >= 1e9) std::snprintf(buf, sizeof buf, "%.2fG", x / 1e9);
  else if (x >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", x / 1e6);
  else if (x >= 1e3) std::snprintf(buf, sizeof buf, "%.1fk", x / 1e3);
  else std::snprintf(buf, sizeof buf, "%.0f", x);
  return buf;
}

void Progress::update(int64_t done, double rate_amount, const std::string& status) {
  if (start_amount_ < 0) {  // the rate is measured from the first update (excludes set-up)
    start_amount_ = rate_amount;
    start_done_ = done;
    start_ = std::chrono::steady_clock::now();
  }
  done_ = done;
  amount_ = rate_amount;
  status_ = status;
  auto now = std::chrono::steady_clock::now();
  double since = std::chrono::duration<double>(now - last_draw_).count();
  if (since >= (tty_ ? 0.2 : 10.0) || (tty_ && done == total_)) {
    last_draw_ = now;
    draw(false);
  }
}

void Progress::finish(const std::string& status) {
  if (!status.empty()) status_ = status;
  draw(true);
}

void Progress::draw(bool final_line) {
  if (!g_enabled) return;
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double rate = elapsed > 0 ? (amount_ - start_amount_) / elapsed : 0;
  double unit_rate = elapsed > 0 ? double(done_ - start_done_) / elapsed : 0;
  double eta = unit_rate > 0 ? double(total_ - done_) / unit_rate : NAN;
  const int width = 24;
  int filled = total_ > 0 ? int(width * double(done_) / double(total_)) : 0;
  std::string bar(filled, '#');
  bar.resize(width, '.');
  char line[512];
  std::snprintf(line, sizeof line, "%s [%s] %lld/%lld %s | %s %s/s | %s %s", label_.c_str(),
                bar.c_str(), (long long)done_, (long long)total_, status_.c_str(),
                format_count(rate).c_str(), rate_unit_.c_str(), final_line ? "took" : "ETA",
                format_duration(final_line ? elapsed : eta).c_str());
  if (tty_) std::fprintf(stderr, "\r\033[K%s%s", line, final_line ? "\n" : "");
  else std::fprintf(stderr, "%s\n", line);
  std::fflush(stderr);
}

}  // namespace depthkit
