#include "depthkit/model/expert_parallel.h"

#include <ATen/ops/argsort.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/custom_function.h>

#include <vector>

#include "depthkit/dist/world.h"

namespace depthkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows to and from the members of a group; backward sends the gradients back the way they came.
class AllToAll : public torch::autograd::Function<AllToAll> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& rows, Group* group, std::vector<int64_t> send,
                            std::vector<int64_t> recv) {
    ctx->saved_data["group"] = int64_t(reinterpret_cast<intptr_t>(group));
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return group->all_to_all(rows, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* group = reinterpret_cast<Group*>(intptr_t(ctx->saved_data["group"].toInt()));
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {group->all_to_all(grads[0].contiguous(), recv, send), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor run_experts_across_ranks(const at::Tensor& rows, const at::Tensor& counts, const ExpertPlacement& placement,
                                    const LocalExperts& experts) {
  if (!placement.split() || !placement.group || placement.group->size() == 1) return experts(rows, counts);
  Group& group = *placement.group;
  const int64_t P = group.size(), local = placement.count;
  // What each member sends each of this rank's experts: the per-expert counts, all-to-all.
  const at::Tensor counts_cpu = counts.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor incoming = group.all_to_all(counts_cpu, std::vector<int64_t>(size_t(P), local),
                                               std::vector<int64_t>(size_t(P), local));  // [P·local]: source-major
  const int64_t* sent = counts_cpu.const_data_ptr<int64_t>();
  const int64_t* got = incoming.const_data_ptr<int64_t>();
  std::vector<int64_t> send(size_t(P), 0), recv(size_t(P), 0);
  for (int64_t m = 0; m < P; ++m)
    for (int64_t e = 0; e < local; ++e) {
      send[size_t(m)] += sent[m * local + e];  // rows is sorted by expert: member m's experts are contiguous
      recv[size_t(m)] += got[m * local + e];
    }
  const at::Tensor arrived = AllToAll::apply(rows, &group, send, recv);  // by source, then expert
  // Reordered by local expert (then source, then arrival): each expert's rows contiguous.
  std::vector<int64_t> start(size_t(P * local));  // where source m's rows for expert e begin
  int64_t at_row = 0;
  for (int64_t m = 0; m < P; ++m)
    for (int64_t e = 0; e < local; ++e) {
      start[size_t(m * local + e)] = at_row;
      at_row += got[m * local + e];
    }
  at::Tensor order = at::empty({at_row}, at::kLong);
  at::Tensor per_expert = at::empty({local}, at::kLong);
  int64_t* o = order.mutable_data_ptr<int64_t>();
  for (int64_t e = 0, k = 0; e < local; ++e) {
    int64_t n = 0;
    for (int64_t m = 0; m < P; ++m)
      for (int64_t i = 0; i < got[m * local + e]; ++i, ++n) o[k++] = start[size_t(m * local + e)] + i;
    per_expert.mutable_data_ptr<int64_t>()[e] = n;
  }
  order = order.to(rows.device());
  const at::Tensor outputs = experts(arrived.index_select(0, order), per_expert.to(counts.device()));
  const at::Tensor by_source = outputs.index_select(0, at::argsort(order));  // back to arrival order
  return AllToAll::apply(by_source, &group, recv, send);
}

}  // namespace depthkit
