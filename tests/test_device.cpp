// train.device: resolving it (util/device.h), the device counters' answers on the CPU, and bench
// on the resolved device. The CUDA cases hold on any machine: with no GPU visible (this project's
// CI, even with a CUDA build of LibTorch) "cuda" must be refused in one line naming the key; with
// one, it must resolve to it.
#include <ATen/detail/CUDAHooksInterface.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>

#include "depthkit/bench/bench.h"
#include "depthkit/dist/world.h"
#include "depthkit/util/device.h"
#include "helpers.h"

namespace depthkit {
namespace {

using test::expect_error;

int64_t visible_gpus() { return at::detail::getCUDAHooks().getNumGPUs(); }

// Sets LOCAL_RANK for one scope and puts back what was there.
struct LocalRank {
  std::optional<std::string> saved;
  explicit LocalRank(const char* value) {
    if (const char* old = std::getenv("LOCAL_RANK")) saved = old;
    if (value) setenv("LOCAL_RANK", value, 1);
    else unsetenv("LOCAL_RANK");
  }
  ~LocalRank() {
    if (saved) setenv("LOCAL_RANK", saved->c_str(), 1);
    else unsetenv("LOCAL_RANK");
  }
};

TEST(Device, CpuResolvesToTheCpuWhateverTheLocalRank) {
  EXPECT_EQ(resolve_device("cpu", 0), at::Device(at::kCPU));
  EXPECT_EQ(resolve_device("cpu", 5), at::Device(at::kCPU));
}

TEST(Device, CudaResolvesToTheLocalRanksGpuOrIsRefusedNamingTheKey) {
  if (visible_gpus() == 0) {
    expect_error([] { resolve_device("cuda", 0); }, {"train.device", "cuda"});
  } else {
    EXPECT_EQ(resolve_device("cuda", 0), at::Device(at::kCUDA, 0));
    EXPECT_EQ(resolve_device("cuda", visible_gpus() - 1), at::Device(at::kCUDA, at::DeviceIndex(visible_gpus() - 1)));
  }
  // A rank past the devices seen (none, or fewer than 4096) and a negative rank.
  expect_error([] { resolve_device("cuda", 4096); }, {"train.device"});
  expect_error([] { resolve_device("cuda", -1); }, {"train.device", "-1"});
  expect_error([] { resolve_device("tpu", 0); }, {"train.device", "tpu"});
}

TEST(Device, LocalRankComesFromTheEnvironment) {
  {
    LocalRank unset(nullptr);
    EXPECT_EQ(LaunchEnv::from_environment().local_rank, 0);
  }
  {
    LocalRank three("3");  // one process may pick its GPU alone
    EXPECT_EQ(LaunchEnv::from_environment().local_rank, 3);
  }
  for (const char* bad : {"", "x", "-1", "1.5", "3 ", "99999999999999999999"}) {
    LocalRank r(bad);
    expect_error([] { LaunchEnv::from_environment(); }, {"LOCAL_RANK"});
  }
}

TEST(Device, CountersAnswerUnknownForTheCpu) {
  const at::Device cpu(at::kCPU);
  EXPECT_EQ(device_allocated_bytes(cpu), -1);
  EXPECT_EQ(device_peak_bytes(cpu), -1);
  reset_device_peak(cpu);  // nothing to reset, nothing to wait for
  synchronize(cpu);
}

TEST(Device, ConfigAcceptsCpuAndCudaOnly) {
  EXPECT_EQ(parse_config("", "x.toml", {"train.steps=1", "train.device=cuda"}).train.device, "cuda");
  EXPECT_EQ(parse_config("", "x.toml", {"train.steps=1", "train.device=cpu"}).train.device, "cpu");
  expect_error([] { parse_config("", "x.toml", {"train.steps=1", "train.device=tpu"}); }, {"train.device", "tpu"});
}

TEST(Device, BenchRunsOnTheResolvedDevice) {
  test::TempDir tmp;
  Config cfg = test::small_config(tmp.str("data"));
  const std::vector<BenchResult> cpu = run_bench_kinds(cfg, {"residual", "dar"}, 2, 1);
  ASSERT_EQ(cpu.size(), 2u);
  for (const BenchResult& r : cpu) {
    EXPECT_EQ(r.device, "cpu");
    EXPECT_EQ(r.peak_device_bytes, -1);  // the CPU's tensors are peak_tensor_bytes
    EXPECT_GT(r.peak_tensor_bytes, 0);
    EXPECT_GT(r.tokens_per_s, 0);
    EXPECT_GT(r.copy_gbs, 0);  // the plain copy the traffic bound is rated against, timed in the rounds
    EXPECT_EQ(r.copy_gbs, cpu[0].copy_gbs);
  }
  // DAR moves more than the residual's adds (`depthkit cost`'s traffic, per step).
  EXPECT_GT(cpu[1].traffic_bytes, cpu[0].traffic_bytes);
  EXPECT_GT(cpu[0].traffic_ms(), 0);
  cfg.train.device = "cuda";
  if (visible_gpus() == 0) {
    expect_error([&] { run_bench(cfg, 1, 0); }, {"train.device"});
  } else {
    const BenchResult r = run_bench(cfg, 2, 1);
    EXPECT_EQ(r.device, "cuda:0");
    EXPECT_GT(r.copy_gbs, 0);  // the copy on the device, between synchronisations
#ifdef DEPTHKIT_WITH_CUDA
    EXPECT_GT(r.peak_device_bytes, 0);
#endif
  }
}

}  // namespace
}  // namespace depthkit
