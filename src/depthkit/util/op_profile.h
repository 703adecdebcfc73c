// Wall time per operator on the calling thread, from ATen's RecordFunction callbacks: every ATen
// operator, depthkit operator and autograd node that runs while a profile records. Self time is
// an operator's time minus the operators it called, so the rows add up to the recorded time
// (the intra-op threads' work is inside the operator that launched it). `depthkit bench --profile`
// prints it to show where a pathway's step time goes.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace depthkit {

class OpProfile {
 public:
  struct Row {
    std::string name;
    int64_t calls = 0;
    double total_s = 0, self_s = 0;
  };

  OpProfile() = default;
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // Records the operators that run on this thread between start() and stop(); at most one profile
  // records on a thread at a time. Recording again adds to the same rows.
  void start();
  void stop();

  // Sorted by self time, largest first.
  std::vector<Row> rows() const;

 private:
  friend struct OpProfileRecorder;
  std::map<std::string, Row> rows_;
  uint64_t handle_ = 0;
  bool recording_ = false;
};

}  // namespace depthkit
