#include "depthkit/util/memory.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>

namespace depthkit {

namespace {

// Forwards every allocation to the allocator it replaced and counts its bytes until release. The
// data pointer is its own context (some kernels, e.g. oneDNN's, require that); a side table keeps
// the inner allocation.
class CountingAllocator final : public at::Allocator {
 public:
  explicit CountingAllocator(at::Allocator* base) : base_(base) {}

  at::DataPtr allocate(size_t n) override {
    at::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    std::lock_guard<std::mutex> lock(mutex_);
    current_ += int64_t(n);
    peak_ = std::max(peak_, current_);
    if (data != nullptr) live_.emplace(data, Live{std::move(inner), int64_t(n)});
    return {data, data, &release, at::Device(at::kCPU)};
  }
  at::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

  static void release(void* data);

  std::mutex mutex_;
  int64_t current_ = 0, peak_ = 0;

 private:
  struct Live {
    at::DataPtr inner;
    int64_t bytes;
  };
  at::Allocator* base_;
  std::unordered_map<void*, Live> live_;
};

CountingAllocator* g_counting = nullptr;  // never destroyed: it must outlive every tensor it made
std::once_flag g_install;

void CountingAllocator::release(void* data) {
  CountingAllocator& a = *g_counting;
  at::DataPtr inner;  // freed after the lock is released
  std::lock_guard<std::mutex> lock(a.mutex_);
  auto it = a.live_.find(data);
  if (it == a.live_.end()) return;
  a.current_ -= it->second.bytes;
  inner = std::move(it->second.inner);
  a.live_.erase(it);
}

}  // namespace

void TensorMemory::install() {
  std::call_once(g_install, [] {
    g_counting = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(g_counting, /*priority=*/100);
  });
}

bool TensorMemory::installed() { return g_counting != nullptr; }

int64_t TensorMemory::current_bytes() {
  if (!g_counting) return 0;
  std::lock_guard<std::mutex> lock(g_counting->mutex_);
  return g_counting->current_;
}

int64_t TensorMemory::peak_bytes() {
  if (!g_counting) return 0;
  std::lock_guard<std::mutex> lock(g_counting->mutex_);
  return g_counting->peak_;
}

void TensorMemory::reset_peak() {
  if (!g_counting) return;
  std::lock_guard<std::mutex> lock(g_counting->mutex_);
  g_counting->peak_ = g_counting->current_;
}

}  // namespace depthkit
