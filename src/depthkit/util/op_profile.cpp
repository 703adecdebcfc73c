#include "depthkit/util/op_profile.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "depthkit/util/error.h"

namespace depthkit {

namespace {
using Clock = std::chrono::steady_clock;
struct Frame {
  std::string name;
  Clock::time_point start;
  double children_s = 0;
};
thread_local OpProfile* active = nullptr;
thread_local std::vector<Frame> frames;
}  // namespace

struct OpProfileRecorder {
  static std::unique_ptr<at::ObserverContext> enter(const at::RecordFunction& fn) {
    if (active) frames.push_back({fn.name(), Clock::now()});
    return nullptr;
  }
  static void exit(const at::RecordFunction& fn, at::ObserverContext*) {
    if (!active || frames.empty()) return;  // entered before start()
    const Frame f = frames.back();
    frames.pop_back();
    const double total = std::chrono::duration<double>(Clock::now() - f.start).count();
    OpProfile::Row& row = active->rows_[f.name];
    row.self_s += total - f.children_s;
    if (!frames.empty()) {
      frames.back().children_s += total;
      // An operator that redispatches to itself (its Autograd kernel calling its CPU kernel) is one
      // call: the inner record adds only its self time.
      if (frames.back().name == f.name) return;
    }
    row.calls += 1;
    row.total_s += total;
  }
};

OpProfile::~OpProfile() {
  if (recording_) stop();
}

void OpProfile::start() {
  if (active) fail("OpProfile: another profile is already recording on this thread");
  active = this;
  frames.clear();
  recording_ = true;
  handle_ = at::addThreadLocalCallback(
      at::RecordFunctionCallback(&OpProfileRecorder::enter, &OpProfileRecorder::exit)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
}

void OpProfile::stop() {
  if (!recording_) return;
  at::removeCallback(handle_);
  active = nullptr;
  frames.clear();
  recording_ = false;
}

std::vector<OpProfile::Row> OpProfile::rows() const {
  std::vector<Row> out;
  for (const auto& [name, row] : rows_) {
    out.push_back(row);
    out.back().name = name;
  }
  std::sort(out.begin(), out.end(), [](const Row& a, const Row& b) { return a.self_s > b.self_s; });
  return out;
}

}  // namespace depthkit
