// The processes of one training job and the c10d process group that connects them
// (docs/training.md, "Many processes"). A job is launched by torchrun or by `depthkit train
// --nproc N` (dist/launch.h), which both describe each process by torchrun's environment
// variables; the processes meet through c10d's TCPStore and talk through ProcessGroupGloo (CPU
// tensors) or ProcessGroupNCCL (CUDA tensors). One process (no variables, or WORLD_SIZE = 1) is a
// World of size 1 whose collectives are the identity, so the trainer has one code path.
//
// The c10d headers are heavy and need defines (USE_C10D_GLOO): they stay in world.cpp.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "depthkit/util/error.h"

namespace depthkit {

// A collective that did not complete: a peer gone, or a timeout. World's collectives throw it;
// the trainer turns a failed synchronising backward (the gradient reducer's) into it.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// This rank stops because another one failed (the message names it): a consequence, which the
// other ranks must not take for a cause.
struct JobStopped : Error {
  using Error::Error;
};

// Where this process stands in a job, read from torchrun's environment variables.
struct LaunchEnv {
  int64_t rank = 0, world_size = 1, local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  // TORCHELASTIC_USE_AGENT_STORE: the launcher (torchrun's agent, or `--nproc`) hosts the
  // TCPStore, so it outlives any rank; otherwise rank 0 hosts it.
  bool agent_store = false;
  // TORCHELASTIC_RESTART_COUNT: a restarted job's keys are kept apart from the earlier attempt's.
  int64_t restart_count = 0;

  // One-line errors name a malformed or inconsistent variable.
  static LaunchEnv from_environment();
};

// Averages gradients across ranks in buckets while backward produces them (c10d's Reducer, as
// DistributedDataParallel does). Per optimizer step with accumulation A, for micro-step m:
//   reduce.begin_micro_step(m == A - 1); loss = ...; reduce.before_backward(); loss.backward();
// Only the last micro-step communicates: earlier ones accumulate in .grad locally, and the last
// one's buckets carry the sums, so that each rank ends with the mean over ranks of its
// accumulated gradient.
class GradientReducer {
 public:
  virtual ~GradientReducer() = default;
  virtual void begin_micro_step(bool last) = 0;
  virtual void before_backward() = 0;
};

// A collective started and not yet waited for (Group::reduce_scatter).
class PendingCollective {
 public:
  virtual ~PendingCollective() = default;
  // Returns once the result is in place; a failed collective is a CollectiveError.
  virtual void wait() = 0;
  // Whether it has completed (wait() would return at once).
  virtual bool done() const { return false; }
};

// Some ranks of a job with a c10d process group of their own (docs/design.md, "Expert
// parallelism": the ranks that split the experts between them, and those that hold the same
// ones), or all of them (World's own collectives). Its collectives run among its members only,
// and every member calls them alike, in the same order. A group of one is the identity.
class Group {
 public:
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  int64_t rank() const { return rank_; }  // this process's place among the members
  int64_t size() const { return int64_t(members_.size()); }
  const std::vector<int64_t>& members() const { return members_; }  // their ranks in the job, ascending

  // Tensors live on the backend's device (CPU for Gloo, CUDA for NCCL) or are moved there and
  // back; each call but reduce_scatter waits for its result.
  void all_reduce_sum(at::Tensor& t);
  void broadcast(at::Tensor& t, int64_t root = 0);  // root: a place among the members
  // Every member's `shard` (1-D, the same length on every member) concatenated in member order.
  at::Tensor all_gather(const at::Tensor& shard);
  // The same, started and not waited for: into `out` ([size() · shard length]), both on the
  // backend's device and alive until wait() (ZeRO-3's prefetch).
  std::unique_ptr<PendingCollective> all_gather_into(const at::Tensor& shard, at::Tensor out);
  // Starts a summing reduce-scatter: `out` receives the sum over members of their pieces[rank()].
  // pieces holds one 1-D tensor per member, pieces[i] as long as member i's `out` (lengths may
  // differ, zero included). Alone, out = pieces[0]. The tensors must stay alive until wait().
  std::unique_ptr<PendingCollective> reduce_scatter(const std::vector<at::Tensor>& pieces, at::Tensor out);
  // The rows of `input` [n, ...] sent in order, send_counts[i] of them to member i; returns the
  // rows received, recv_counts[i] from member i, in member order (the counts agreed beforehand).
  at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_counts,
                        const std::vector<int64_t>& recv_counts);
  // Point to point, by place among the members. `tag` pairs a send with its receive (Gloo matches
  // by tag; NCCL in the order they are issued between two members, which the pipeline keeps).
  void send(const at::Tensor& t, int64_t dst, int tag = 0);
  void recv(at::Tensor& t, int64_t src, int tag = 0);
  // A send started and not waited for (the pipeline's): the tensor is kept until wait().
  std::unique_ptr<PendingCollective> isend(const at::Tensor& t, int64_t dst, int tag);
  // Averages the gradients of `params` over the members (c10d's Reducer; World::gradient_reducer).
  std::unique_ptr<GradientReducer> gradient_reducer(const std::vector<at::Tensor>& params,
                                                    int64_t bucket_bytes = 25 << 20);

  // The bytes this member has handed to each kind of collective ("all_reduce", "all_to_all", ...),
  // counted by the calls above (a group of one counts nothing); count() adds what the group's
  // users send by other means (the Reducer's all-reduces).
  const std::map<std::string, int64_t>& traffic() const { return traffic_; }
  void count(const std::string& collective, int64_t bytes) { traffic_[collective] += bytes; }

 private:
  friend class World;
  struct Impl;
  Group(std::unique_ptr<Impl> impl, std::vector<int64_t> members, int64_t rank);
  std::unique_ptr<Impl> impl_;
  std::vector<int64_t> members_;
  int64_t rank_ = 0;
  std::map<std::string, int64_t> traffic_;
};

class World {
 public:
  // What a rank starts from, name → value ({"train.seed", "1"}): ranks whose facts differ refuse to
  // start, naming them, instead of training a model no config describes (or crashing on the first
  // collective whose sizes differ).
  using Facts = std::vector<std::pair<std::string, std::string>>;

  World();  // one process
  // Joins the job `env` describes: rendezvous through the TCPStore, where every rank claims its
  // RANK and says its WORLD_SIZE and `facts` (rank 0's are read first, so that a rank launched
  // differently is named at once), then the process group of `backend` ("gloo" | "nccl"). The
  // rendezvous and every collective are bounded by timeout_s.
  World(const LaunchEnv& env, const std::string& backend, double timeout_s, const Facts& facts = {});
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  bool root() const { return rank_ == 0; }
  bool distributed() const { return size_ > 1; }

  // Collectives over every rank (the identity in one process): all().
  Group& all() { return *all_; }
  void all_reduce_sum(at::Tensor& t) { all_->all_reduce_sum(t); }
  void broadcast(at::Tensor& t, int64_t root = 0) { all_->broadcast(t, root); }
  at::Tensor all_gather(const at::Tensor& shard) { return all_->all_gather(shard); }
  std::unique_ptr<PendingCollective> reduce_scatter(const std::vector<at::Tensor>& pieces, at::Tensor out) {
    return all_->reduce_scatter(pieces, std::move(out));
  }
  void send(const at::Tensor& t, int64_t dst) { all_->send(t, dst); }
  void recv(at::Tensor& t, int64_t src) { all_->recv(t, src); }
  // A group of some ranks (ascending, this one among them), with its own process group on the
  // job's backend; `name` keeps its rendezvous apart from other groups'. Every member calls it
  // with the same name and members; the whole job's ranks give all()'s process group again.
  std::unique_ptr<Group> group(const std::string& name, const std::vector<int64_t>& members);

  // Start-up: every rank says whether its part succeeded and what it starts from. Returns on all
  // ranks when all succeeded with the same facts. Otherwise throws, on the ranks that succeeded:
  // JobStopped naming the ranks that failed (those rethrow their own error), or Error naming the
  // facts that differ, rank by rank. Through the store: a rank gone or stuck is named too.
  void agree(bool ok, const std::string& what, const Facts& facts = {});

  // The gradient reducer for `params` over every rank (the identity in one process).
  std::unique_ptr<GradientReducer> gradient_reducer(const std::vector<at::Tensor>& params,
                                                    int64_t bucket_bytes = 25 << 20) {
    return all_->gradient_reducer(params, bucket_bytes);
  }

  // The step this rank is at, published with its heartbeat (a stuck rank is then named).
  void set_step(int64_t step);

  // Turns the exception that stopped this rank into the job's one-line error and throws it. This
  // rank's own failure (anything but the two types above) is published for the others and
  // rethrown. A CollectiveError is explained from the store: by the rank that failed (its
  // published error), else by the cause another rank already found, else by a rank whose
  // heartbeat stopped, else by the rank that lags; that explanation is thrown as JobStopped and
  // published too. Afterwards a process group that failed is left as it is (it can be neither used
  // nor safely torn down).
  [[noreturn]] void fail_job(std::exception_ptr error);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::unique_ptr<Group> all_;
  int64_t rank_ = 0, size_ = 1;
};

}  // namespace depthkit
