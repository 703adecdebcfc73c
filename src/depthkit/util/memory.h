// Peak memory, as `train`, `bench` and `compare` report it.
//   - peak_rss_bytes(): the process's peak resident set (LibTorch, data, the heap's slack).
//   - TensorMemory: the bytes of live CPU tensor storage, current and peak, counted by an
//     allocator installed in front of LibTorch's CPU allocator (the CPU's counterpart of the CUDA
//     caching allocator's max_memory_allocated): what a model's parameters, optimizer state and
//     activations need, without the heap's slack.
#pragma once
#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>

namespace depthkit {

// The machine's physical memory: no single run can use more, so sizes past it are refused up front.
inline int64_t physical_memory_bytes() { return int64_t(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE); }

inline int64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return int64_t(ru.ru_maxrss) * 1024;  // Linux reports kilobytes
}

class TensorMemory {
 public:
  // Counts every CPU tensor allocated from now on (those allocated before are not counted when
  // freed either). Idempotent; the counting stays installed for the life of the process.
  static void install();
  static bool installed();
  static int64_t current_bytes();
  static int64_t peak_bytes();
  static void reset_peak();  // peak := current
};

}  // namespace depthkit
